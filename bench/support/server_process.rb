# frozen_string_literal: true

require "socket"
require "fileutils"
require "tmpdir"

module NeverBlockBench
  # One HTTP server under test, run as a process of its own in a session of
  # its own (setsid), so that stopping it stops everything it forked (Falcon's
  # worker, Puma's cluster workers) and nothing is left listening.
  #
  #   server = ServerProcess.start("puma", ["bundle", "exec", "puma", ...], port: 9292)
  #   server.wait_until_ready   # GET / answered (any status)
  #   ...
  #   server.stop               # SIGTERM to the session, SIGKILL after 10 s
  #
  # Its output goes to a log file in a temporary directory, kept until
  # {#stop} (and printed by {#log_tail} when it failed to start).
  class ServerProcess
    # Seconds to wait for a first answer.
    START_TIMEOUT = 60
    # Seconds between SIGTERM and SIGKILL.
    STOP_TIMEOUT = 10

    # Every server started and not yet stopped, for {.stop_all}.
    @running = []

    class << self
      # @param name [String] for messages
      # @param command [Array<String>] argv, without setsid
      # @param port [Integer] where it listens on 127.0.0.1
      # @param env [Hash{String => String, nil}] for Process.spawn
      # @param dir [String, nil] working directory (the current one unless given)
      # @return [ServerProcess] started (not necessarily ready)
      def start(name, command, port:, env: {}, dir: nil)
        server = new(name, command, port: port, env: env, dir: dir)
        @running << server
        server.send(:spawn)
        server
      end

      # Stops every server still running. For `ensure` and signal traps.
      # @return [void]
      def stop_all
        @running.dup.each(&:stop)
      end

      # @api private
      def forget(server)
        @running.delete(server)
      end

      # A port on 127.0.0.1 that nothing listens on now (the kernel's pick).
      # @return [Integer]
      def free_port
        server = TCPServer.new("127.0.0.1", 0)
        server.addr[1]
      ensure
        server&.close
      end

      # @param port [Integer]
      # @return [Boolean] whether a listener could bind 127.0.0.1:port now
      def port_free?(port)
        TCPServer.new("127.0.0.1", port).close
        true
      rescue SystemCallError
        false
      end
    end

    # @return [String]
    attr_reader :name
    # @return [Integer]
    attr_reader :port
    # @return [Integer, nil] the session leader's pid (= the session and process group id)
    attr_reader :pid

    def initialize(name, command, port:, env:, dir:)
      @name = name
      @command = command
      @port = port
      @env = env
      @dir = dir
      @tmpdir = Dir.mktmpdir("neverblock-bench-#{name.gsub(/\W+/, '-')}-")
      @log = File.join(@tmpdir, "server.log")
    end

    # @return [String] a directory that lives as long as the server (for pid files, configs)
    attr_reader :tmpdir

    # Waits until an HTTP GET of `path` gets any response.
    #
    # @param path [String]
    # @param timeout [Numeric] seconds
    # @return [void]
    # @raise [RuntimeError] when the process exits or does not answer in time
    #   (the message has the end of its log)
    def wait_until_ready(path: "/", timeout: START_TIMEOUT)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
      loop do
        return if answers?(path)
        raise "#{@name} exited before it answered (#{@status.inspect}):\n#{log_tail}" if exited?
        raise "#{@name} did not answer within #{timeout} s:\n#{log_tail}" if
          Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

        sleep 0.1
      end
    end

    # Stops the whole session: SIGTERM, then SIGKILL after {STOP_TIMEOUT};
    # checks that the port is free again. Idempotent.
    #
    # @return [Boolean] true when the port is free afterwards
    def stop
      return true unless @pid

      signal_session("TERM")
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + STOP_TIMEOUT
      sleep 0.05 until session_gone? || Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
      unless session_gone?
        warn "  #{@name} did not stop within #{STOP_TIMEOUT} s after SIGTERM; SIGKILL"
        signal_session("KILL")
        sleep 0.05 until session_gone? || Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline + 5
      end
      reap
      @pid = nil
      self.class.forget(self)
      free = wait_for_port_free
      warn "  #{@name}: port #{@port} still in use after stopping" unless free
      FileUtils.rm_rf(@tmpdir)
      free
    end

    # @param lines [Integer]
    # @return [String] the last lines the server wrote
    def log_tail(lines = 20)
      File.exist?(@log) ? File.readlines(@log).last(lines).join : "(no output)"
    end

    # @return [String] everything the server wrote so far
    def log
      File.exist?(@log) ? File.read(@log) : ""
    end

    private

    def spawn
      options = { %i[out err] => [@log, "w"], in: File::NULL }
      options[:chdir] = @dir if @dir
      # setsid makes the server the leader of a new session and process
      # group, whose id is its pid: one signal reaches all it forks.
      @pid = Process.spawn(@env, "setsid", *@command, **options)
    end

    def answers?(path)
      Socket.tcp("127.0.0.1", @port, connect_timeout: 1) do |socket|
        socket.write("GET #{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return false unless socket.wait_readable(5)

        !socket.readpartial(64).empty?
      end
    rescue SystemCallError, EOFError, IOError
      false
    end

    def exited?
      return true if @status

      _, @status = Process.waitpid2(@pid, Process::WNOHANG)
      !@status.nil?
    end

    def signal_session(signal)
      Process.kill(signal, -@pid)
    rescue Errno::ESRCH
      nil
    end

    # True when no process of the session is left (kill 0 to the group fails).
    def session_gone?
      exited? # reaps the leader, so that a zombie does not count
      Process.kill(0, -@pid)
      false
    rescue Errno::ESRCH
      true
    rescue Errno::EPERM
      false
    end

    def reap
      Process.wait(@pid) unless exited?
    rescue Errno::ECHILD
      nil
    end

    def wait_for_port_free
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 5
      until self.class.port_free?(@port)
        return false if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

        sleep 0.1
      end
      true
    end
  end
end
