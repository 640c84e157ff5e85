# frozen_string_literal: true

require "socket"
require "uri"
require_relative "delay_reactor"
require_relative "machine"

module NeverBlockBench
  # A local HTTP/1.1 server, in a child process, that answers each request
  # after the delay the request names: a slow but endlessly scalable back end
  # for the client benchmarks and the demo.
  #
  #   GET /delay/0.5        answered after 0.5 s
  #   GET /anything?delay=0.1  answered after 0.1 s
  #   GET /                 answered at once
  #
  # Responses are `200 OK` with a short text body; connections are kept alive
  # unless the client says otherwise (HTTP/1.0 rules apply to 1.0 clients).
  #
  #   server = NeverBlockBench::DelayServer.start
  #   Net::HTTP.get(server.uri("/delay/0.1"))
  #   server.stop
  #
  # Run it in the foreground (for wrk, curl) with
  #   ruby bench/support/delay_server.rb [--port 8080] [--host 127.0.0.1]
  class DelayServer
    # Length of the accept queue; the kernel caps it at net.core.somaxconn.
    BACKLOG = 4096
    # File descriptors the server process asks for (soft RLIMIT_NOFILE).
    FD_LIMIT = 65_536

    attr_reader :host, :port, :pid

    # Binds a listening socket on an ephemeral port and forks the server.
    # The socket is listening before this returns, so clients may connect
    # at once: there is no start-up race.
    #
    # @param host [String] address to bind, 127.0.0.1 unless told
    # @param port [Integer] 0 picks a free port
    # @return [DelayServer] the running server; call {#stop} when done
    def self.start(host: "127.0.0.1", port: 0)
      listener = listen(host, port)
      bound_port = listener.local_address.ip_port
      lifeline_reader, lifeline_writer = IO.pipe
      pid = fork { serve_in_child(listener, lifeline_reader, lifeline_writer) }
      listener.close
      lifeline_reader.close
      new(pid, host, bound_port, lifeline_writer)
    rescue StandardError
      listener&.close unless listener&.closed?
      raise
    end

    # @return [TCPServer]
    def self.listen(host, port)
      Machine.raise_fd_limit(FD_LIMIT)
      listener = TCPServer.new(host, port)
      listener.listen(BACKLOG)
      listener
    end

    # The child's body. Uses exit! so that at_exit handlers inherited from the
    # parent (test runners, other servers' #stop) do not run here.
    def self.serve_in_child(listener, lifeline_reader, lifeline_writer)
      lifeline_writer.close
      Process.setproctitle("neverblock-bench delay server :#{listener.local_address.ip_port}")
      reactor = DelayReactor.new(listener, lifeline: lifeline_reader)
      %w[TERM INT].each { |signal| trap(signal) { reactor.stop } }
      reactor.run
      exit!(0)
    rescue Exception => e # rubocop:disable Lint/RescueException -- last resort in a child
      warn "delay server crashed: #{e.class}: #{e.message}\n  #{e.backtrace&.first(5)&.join("\n  ")}"
      exit!(1)
    end
    private_class_method :serve_in_child

    def initialize(pid, host, port, lifeline)
      @pid = pid
      @host = host
      @port = port
      @lifeline = lifeline
      @owner = Process.pid
      at_exit { stop if Process.pid == @owner }
    end

    # @param path [String] e.g. "/delay/0.5"
    # @return [URI::HTTP]
    def uri(path = "/")
      URI("http://#{@host}:#{@port}#{path}")
    end

    # @param seconds [Float] delay the server waits before answering
    # @return [String] request path asking for that delay
    def self.path_for(seconds)
      "/delay/#{format('%.3f', seconds)}"
    end

    # @return [Boolean] whether the server process is still running
    def running?
      return false unless @pid

      Process.kill(0, @pid) && Process.wait(@pid, Process::WNOHANG).nil?
    rescue Errno::ESRCH, Errno::ECHILD
      false
    end

    # Stops the server: closes the lifeline (the server exits at its next
    # wake-up), then TERM and finally KILL if it is still there after
    # `timeout` seconds. Idempotent.
    #
    # @param timeout [Float] seconds to wait for a clean exit
    # @return [Boolean] true if the server exited cleanly (status 0)
    def stop(timeout = 5.0)
      return @clean_exit if @pid.nil?

      @lifeline.close unless @lifeline.closed?
      status = wait_for_exit(timeout) || signal_and_wait("TERM", 1.0) || signal_and_wait("KILL", 1.0)
      @pid = nil
      @clean_exit = status == :reaped_elsewhere || status&.success? || false
    end

    private

    def signal_and_wait(signal, timeout)
      Process.kill(signal, @pid)
      wait_for_exit(timeout)
    rescue Errno::ESRCH
      wait_for_exit(timeout)
    end

    # @return [Process::Status, :reaped_elsewhere, nil] nil if still running
    #   after `timeout` seconds
    def wait_for_exit(timeout)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
      loop do
        _, status = Process.wait2(@pid, Process::WNOHANG)
        return status if status
        return nil if Process.clock_gettime(Process::CLOCK_MONOTONIC) >= deadline

        sleep 0.01
      end
    rescue Errno::ECHILD
      :reaped_elsewhere # e.g. by #running? or a Process.waitall in the caller
    end
  end
end

if $PROGRAM_NAME == __FILE__
  require "optparse"
  options = { host: "127.0.0.1", port: 8080 }
  OptionParser.new do |parser|
    parser.banner = "Usage: ruby #{$PROGRAM_NAME} [--host HOST] [--port PORT]"
    parser.on("--host HOST", "address to bind (#{options[:host]})") { |value| options[:host] = value }
    parser.on("--port PORT", Integer, "port, 0 for any free one (#{options[:port]})") { |value| options[:port] = value }
  end.parse!
  listener = NeverBlockBench::DelayServer.listen(options[:host], options[:port])
  reactor = NeverBlockBench::DelayReactor.new(listener)
  %w[TERM INT].each { |signal| trap(signal) { reactor.stop } }
  $stdout.sync = true
  puts "delay server on http://#{options[:host]}:#{listener.local_address.ip_port}/delay/SECONDS (Ctrl-C stops)"
  reactor.run
end
