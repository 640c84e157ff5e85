# frozen_string_literal: true

require "test_helper"
require "open3"
require "rbconfig"

# Shared by the conformance tests: they check that NeverBlock::Scheduler
# behaves like Ruby's reference scheduler (test/fiber in ruby/ruby) in every
# case Ruby's own suite covers. Most of them use the scheduler the raw way:
#
#   Thread.new do
#     Fiber.set_scheduler(NeverBlock::Scheduler.new)
#     Fiber.schedule { ... }
#   end.join # the loop runs in Scheduler#close, when the thread ends
module ConformanceSupport
  # Seconds a scheduler thread may run before the test calls it hung.
  HANG_LIMIT = 5

  # Runs the block on a new thread whose fiber scheduler is a fresh
  # `scheduler_class.new(**options)`, set with Fiber.set_scheduler; the loop
  # runs when the block returns and the thread ends. Exceptions raised in
  # fibers started with {#schedule} (failed assertions included) are
  # re-raised here, after the thread has finished.
  #
  # A thread still running after `limit` seconds is killed and the test
  # fails as hung, showing where the thread was.
  #
  # @return [Object] the block's value.
  def on_scheduler_thread(limit: HANG_LIMIT, scheduler_class: NeverBlock::Scheduler, **options, &block)
    thread = Thread.new do
      Thread.current.report_on_exception = false
      Fiber.set_scheduler(scheduler_class.new(**options))
      block.call
    end
    unless thread.join(limit)
      where = thread.backtrace || []
      thread.kill
      thread.join(2)
      flunk "hung: the scheduler thread was still running after #{limit} s, at:\n  #{where.first(12).join("\n  ")}"
    end
    value = thread.value
    raise fiber_errors.pop unless fiber_errors.empty?

    value
  end

  # Fiber.schedule, recording any exception the fiber raises so that
  # {#on_scheduler_thread} re-raises it in the test.
  # @return [Fiber]
  def schedule(&block)
    Fiber.schedule do
      block.call
    rescue Exception => e # rubocop:disable Lint/RescueException -- failed assertions too
      fiber_errors << e
    end
  end

  # @return [Thread::Queue] exceptions raised in fibers started with {#schedule}.
  attr_reader :fiber_errors

  # Minitest hook: a fresh error queue for each test.
  def before_setup
    super
    @fiber_errors = Thread::Queue.new
  end

  # Skips the test on Rubies older than `version`.
  # @param reason [String] what the older Ruby lacks or gets wrong.
  def requires_ruby(version, reason)
    skip "needs Ruby #{version}+ (this is #{RUBY_VERSION}): #{reason}" if Gem::Version.new(RUBY_VERSION) < Gem::Version.new(version)
  end

  # Runs `code` in a child Ruby with lib/ on the load path (and, under
  # `bundle exec`, Bundler through RUBYOPT). Unlike TestSupport#run_ruby it
  # adds no Timeout wrapper, whose watchdog thread would hide a deadlock
  # from Ruby's deadlock detector; a child still running after `limit`
  # seconds is killed and the test fails.
  #
  # @return [Array(String, String, Process::Status)] stdout, stderr, status.
  def run_script(code, limit: 20)
    lib = File.expand_path("../../../lib", __dir__)
    Open3.popen3(RbConfig.ruby, "-I#{lib}", "-e", code) do |stdin, stdout, stderr, waiter|
      stdin.close
      out = Thread.new { stdout.read }
      err = Thread.new { stderr.read }
      unless waiter.join(limit)
        Process.kill(:KILL, waiter.pid)
        flunk "the child Ruby was still running after #{limit} s; stderr so far: #{err.join(1) && err.value}"
      end
      [out.value, err.value, waiter.value]
    end
  end

  # Calls the block until it returns true, for up to `limit` seconds; for
  # waiting on state another thread changes (e.g. a thread going to sleep).
  # @return [void]
  # A plain threaded HTTP server on 127.0.0.1 (the loop under test only runs
  # clients): each request is answered after `delay` seconds with its path
  # as the body, and the connection closed. Stopped at teardown.
  # @return [Integer] its port.
  def slow_http_server(delay: 0.5)
    tcp = TCPServer.new("127.0.0.1", 0)
    thread = Thread.new do
      loop do
        Thread.new(tcp.accept) do |client|
          path = client.gets[%r{\AGET (\S+)}, 1]
          nil until client.gets == "\r\n"
          Kernel.sleep delay
          client.write("HTTP/1.1 200 OK\r\nContent-Length: #{path.bytesize}\r\nConnection: close\r\n\r\n#{path}")
        ensure
          client.close
        end
      end
    rescue IOError
      nil # the listening socket was closed: the test is over
    end
    (@slow_servers ||= []) << [tcp, thread]
    tcp.local_address.ip_port
  end

  # Minitest hook: stops the #slow_http_server's.
  def after_teardown
    @slow_servers&.each do |tcp, thread|
      tcp.close
      thread.join(2)
    end
    super
  end

  def wait_for(what, limit: 30)
    deadline = now + limit
    until yield
      flunk "gave up waiting for #{what} after #{limit} s" if now > deadline
      Thread.pass
      Kernel.sleep(0.001)
    end
  end

  # Runs the block with Ruby's "IO::Buffer is experimental" warning off.
  def quietly_experimental
    previous = Warning[:experimental]
    Warning[:experimental] = false
    yield
  ensure
    Warning[:experimental] = previous
  end
end

# Base class of the conformance tests: each test starts its own loop.
class ConformanceTest < PlainTest
  include ConformanceSupport
end
