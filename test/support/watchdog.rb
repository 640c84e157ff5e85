# frozen_string_literal: true

require "rbconfig"

# The suite's per-test watchdog: when one test has run for longer than
# `NEVERBLOCK_TEST_WATCHDOG` seconds (default 300; 0 turns it off), it
# writes to stderr what the whole process is doing, once per test, so that
# a hung suite names the test and the wait it hangs in:
#
# - every thread: its backtrace, and the system call its kernel thread is
#   in (/proc/self/task/TID/syscall and wchan: poll, ppoll, epoll_pwait2...);
# - every NeverBlock scheduler still open: each task and each fiber parked
#   in it, with what it waits on (an IO and its descriptor, a token, the
#   selector's ready queue) and its backtrace;
# - every open descriptor (/proc/self/fd), with, for TCP sockets, both ends
#   and the bytes queued unread or unsent (/proc/net/tcp, tcp6), and for
#   epoll sets, the descriptors each watches (/proc/self/fdinfo).
#
# Why a thread of its own, not NeverBlock::Testing's per-test timeout: that
# timeout is a timer of the test's event loop, and a hang worth finding is
# one where that loop cannot turn (a C call that blocks its thread). Ruby
# runs this thread meanwhile: a blocked C call waits without the GVL, and a
# spinning one is preempted every 100 ms.
#
# The thread waits with a time limit only while a test runs, so that Ruby's
# deadlock detector still sees a process where nothing else can happen.
#
# Wired in by TestWatchdog::Hook, which test_helper includes in the suite's
# base classes; #watch and #done are called on whatever thread or fiber
# runs the test.
class TestWatchdog
  # Wraps a test's whole run: setup, the test, teardown and, for a
  # NeverBlockTest (include it after NeverBlock::Minitest), the closing of
  # the test's event loop, where the Ruby 3.4 hang of MySQLConnectTests sat
  # (Scheduler#close waiting for a thread-pool job that never ended).
  module Hook
    # Minitest's per-test entry point.
    # @return [Minitest::Result]
    def run
      TestWatchdog.instance.watch("#{self.class}##{name}")
      super
    ensure
      TestWatchdog.instance.done
    end
  end

  # Seconds a test may run before the dump, unless NEVERBLOCK_TEST_WATCHDOG says.
  # Above the longest per-test timeout (neverblock_timeout 120) and the
  # slowest plain tests (a `rails new` ~60 s on a loaded machine).
  DEFAULT_SECONDS = 300

  # Frames shown of each backtrace.
  FRAMES = 40

  # System calls a hung thread is likely to be in, by number (x86_64 Linux).
  SYSCALLS = {
    0 => "read", 1 => "write", 7 => "poll", 23 => "select", 35 => "nanosleep", 44 => "sendto",
    45 => "recvfrom", 61 => "wait4", 202 => "futex", 219 => "restart_syscall", 230 => "clock_nanosleep",
    232 => "epoll_wait", 270 => "pselect6", 271 => "ppoll", 281 => "epoll_pwait", 426 => "io_uring_enter",
    441 => "epoll_pwait2"
  }.freeze

  # TCP states in /proc/net/tcp.
  TCP_STATES = %w[? ESTABLISHED SYN_SENT SYN_RECV FIN_WAIT1 FIN_WAIT2 TIME_WAIT CLOSE CLOSE_WAIT LAST_ACK
                  LISTEN CLOSING].freeze

  class << self
    # @return [TestWatchdog] the process's watchdog.
    def instance
      @instance ||= new(seconds_from_environment)
    end

    # @return [Float] NEVERBLOCK_TEST_WATCHDOG, or DEFAULT_SECONDS.
    # @raise [ArgumentError] for a value that is not a number of seconds.
    def seconds_from_environment
      text = ENV.fetch("NEVERBLOCK_TEST_WATCHDOG", "").strip
      return DEFAULT_SECONDS.to_f if text.empty?

      seconds = Float(text, exception: false)
      unless seconds && seconds >= 0
        raise ArgumentError, "NEVERBLOCK_TEST_WATCHDOG must be a number of seconds (0: off), got #{text.inspect}"
      end

      seconds
    end
  end

  # @param seconds [Numeric] how long a test may run before the dump; 0: never.
  # @param output [IO] where the dump goes.
  def initialize(seconds, output: $stderr)
    @seconds = seconds
    @output = output
    @lock = Thread::Mutex.new
    @changed = Thread::ConditionVariable.new
    @label = nil # the test running now
    @started = nil
    @test = 0 # bumped at each #watch: a dump is made once per test
    @reported = 0
    @thread = nil
  end

  # A test starts: dump if it is still running `seconds` from now.
  # @param label [String] names the test.
  # @return [void]
  def watch(label)
    return unless @seconds.positive?

    @lock.synchronize do
      @label = label
      @started = clock
      @test += 1
      @thread = start_thread unless @thread&.alive? # also in a forked child
      @changed.signal
    end
  end

  # The test that #watch named has ended.
  # @return [void]
  def done
    return unless @seconds.positive?

    @lock.synchronize do
      @label = nil
      @changed.signal
    end
  end

  # The report, as the watchdog writes it.
  # @param label [String] the test that overran.
  # @param seconds [Numeric] how long it has run.
  # @return [String]
  def report(label, seconds)
    sections = ["=== NeverBlock test watchdog: #{label} has run for #{seconds.round} s " \
                "(NEVERBLOCK_TEST_WATCHDOG=#{@seconds}); process #{Process.pid}:",
                threads, schedulers, descriptors, "=== end of watchdog report for #{label}"]
    "#{sections.join("\n")}\n"
  end

  private

  def start_thread
    thread = Thread.new { run }
    thread.name = "test-watchdog"
    thread.report_on_exception = true
    thread
  end

  def run
    loop do
      label, seconds = next_overrun
      begin
        @output.write(report(label, seconds))
        @output.flush
      rescue StandardError => e # a report that fails must not end the watch
        @output.write("=== NeverBlock test watchdog: #{label}: the report failed: #{e.class}: #{e.message}\n")
      end
    end
  end

  # Waits until a test has run longer than @seconds and was not reported yet.
  # @return [Array(String, Float)] its label and how long it has run.
  def next_overrun
    @lock.synchronize do
      loop do
        if @label.nil? || @reported == @test
          @changed.wait(@lock) # no time limit: Ruby's deadlock detector stays useful
        else
          remaining = @started + @seconds - clock
          if remaining.positive?
            @changed.wait(@lock, remaining)
          else
            @reported = @test
            return [@label, clock - @started]
          end
        end
      end
    end
  end

  def clock
    Process.clock_gettime(Process::CLOCK_MONOTONIC)
  end

  # --- The report's sections ---------------------------------------------

  def threads
    lines = ["--- threads"]
    Thread.list.each do |thread|
      next if thread.equal?(Thread.current)

      tid = thread.respond_to?(:native_thread_id) ? thread.native_thread_id : nil
      lines << "#{thread.inspect} status=#{thread.status.inspect}#{" tid=#{tid} #{kernel_wait(tid)}" if tid}"
      lines.concat(frames(thread.backtrace))
    end
    lines.join("\n")
  end

  # The system call a kernel thread is in, and where in the kernel it sleeps.
  def kernel_wait(tid)
    syscall = File.read("/proc/self/task/#{tid}/syscall").split.first
    wchan = File.read("/proc/self/task/#{tid}/wchan").strip
    number = Integer(syscall, exception: false)
    name = number && RbConfig::CONFIG["host_cpu"] == "x86_64" ? SYSCALLS[number] : nil
    "syscall=#{name || syscall} wchan=#{wchan.empty? ? '-' : wchan}"
  rescue SystemCallError, IOError
    "(no /proc/self/task/#{tid})"
  end

  def schedulers
    lines = ["--- NeverBlock schedulers"]
    return lines.first unless defined?(NeverBlock::Scheduler)

    ObjectSpace.each_object(NeverBlock::Scheduler) do |scheduler|
      next if scheduler.closed?

      lines << "#{scheduler.inspect} on #{scheduler.thread.inspect}, running=#{scheduler.running.inspect}"
      lines.concat(fibers(scheduler))
    end
    lines.join("\n")
  end

  # Each task, and each other fiber parked in the scheduler, with its wait.
  # Reads the scheduler's @waits (fiber => token, IO, :queued, :io): a
  # diagnosis of a stuck loop wants exactly what the loop believes.
  def fibers(scheduler)
    waits = scheduler.instance_variable_get(:@waits) || {}
    tasks = scheduler.tasks
    seen = {}.compare_by_identity
    lines = tasks.flat_map do |task|
      fiber = task.fiber
      seen[fiber] = true if fiber
      fiber_lines("  #{task.inspect}", fiber, waits)
    end
    waits.each_key do |fiber|
      lines.concat(fiber_lines("  #{fiber.inspect} (not a task)", fiber, waits)) unless seen[fiber]
    end
    lines
  end

  def fiber_lines(head, fiber, waits)
    wait = fiber && waits[fiber]
    line = "#{head} waits: #{describe_wait(wait)}"
    [line, *frames(fiber&.alive? ? fiber.backtrace : nil)]
  end

  def describe_wait(wait)
    case wait
    when nil then "(not in a wait of the loop: running, ready, or outside the loop's care)"
    when Integer then "suspended (token #{wait})"
    when IO then "in the selector on #{wait.inspect} fd #{wait.closed? ? 'closed' : wait.fileno}"
    else "in the selector (#{wait.inspect})"
    end
  end

  def frames(backtrace)
    return ["    (no backtrace)"] if backtrace.nil? || backtrace.empty?

    shown = backtrace.first(FRAMES).map { |frame| "    #{frame}" }
    shown << "    ... #{backtrace.size - FRAMES} more" if backtrace.size > FRAMES
    shown
  end

  def descriptors
    lines = ["--- descriptors (/proc/self/fd)"]
    return "#{lines.first}: not available" unless File.directory?("/proc/self/fd")

    sockets = tcp_sockets
    Dir.children("/proc/self/fd").map { |name| Integer(name) }.sort.each do |fd|
      target = File.readlink("/proc/self/fd/#{fd}")
      lines << "  fd #{fd} -> #{target}#{describe_target(fd, target, sockets)}"
    rescue SystemCallError
      nil # closed meanwhile (the one Dir.children used)
    end
    lines.join("\n")
  end

  def describe_target(fd, target, sockets)
    if (inode = target[/\Asocket:\[(\d+)\]\z/, 1]) && (socket = sockets[inode])
      " #{socket}"
    elsif target == "anon_inode:[eventpoll]"
      " watches #{epoll_watches(fd)}"
    else
      ""
    end
  end

  # inode => "tcp 127.0.0.1:1234 -> 127.0.0.1:3306 ESTABLISHED rx 65 tx 0"
  def tcp_sockets
    %w[tcp tcp6].each_with_object({}) do |table, sockets|
      File.foreach("/proc/net/#{table}").drop(1).each do |row|
        fields = row.split
        tx, rx = fields[4].split(":").map { |hex| Integer(hex, 16) }
        state = TCP_STATES[Integer(fields[3], 16)] || fields[3]
        sockets[fields[9]] = "#{table} #{address(fields[1])} -> #{address(fields[2])} #{state} rx #{rx} tx #{tx}"
      end
    rescue SystemCallError
      nil
    end
  end

  # "0100007F:0CEA" -> "127.0.0.1:3306"; IPv6 as eight groups.
  def address(field)
    host, port = field.split(":")
    words = host.scan(/\h{8}/).map { |word| [word].pack("H*").unpack1("L<") }
    ip = if words.size == 1
           [words.first].pack("N").unpack("C4").join(".")
         else
           words.pack("N*").unpack("n8").map { |group| group.to_s(16) }.join(":")
         end
    "#{ip}:#{Integer(port, 16)}"
  end

  # "fd 5 (events 0x19), fd 9 (events 0x1)" from the epoll set's fdinfo.
  def epoll_watches(fd)
    watches = File.foreach("/proc/self/fdinfo/#{fd}").filter_map do |line|
      next unless line.start_with?("tfd:")

      descriptor = line[/tfd:\s*(\d+)/, 1]
      events = line[/events:\s*(\h+)/, 1]
      "fd #{descriptor} (events 0x#{events})"
    end
    watches.empty? ? "nothing" : watches.join(", ")
  rescue SystemCallError
    "(no fdinfo)"
  end
end
