# frozen_string_literal: true

require "socket"
require_relative "delay_connection"
require_relative "timer_heap"

module NeverBlockBench
  # The event loop of {DelayServer}: one thread, non-blocking sockets,
  # IO.select and a {TimerHeap}. A request waiting out its delay costs a heap
  # entry, not a thread or a fiber, so thousands of concurrent delayed
  # requests are answered on time, and the server is never the bottleneck of
  # a client benchmark at the delays it exists for.
  #
  # It deliberately uses nothing from NeverBlock: the benchmarks must not
  # measure NeverBlock against itself.
  class DelayReactor
    # Connections accepted per wake-up before the loop serves the others.
    ACCEPT_BATCH = 256
    # How long to stop accepting when out of file descriptors, in seconds.
    ACCEPT_BACKOFF = 0.05

    # @param listener [TCPServer] listening socket; the reactor closes it
    # @param lifeline [IO, nil] read end of a pipe; the loop stops when it
    #   becomes readable (its writer closed it, or exited)
    def initialize(listener, lifeline: nil)
      @listener = listener
      @lifeline = lifeline
      @connections = {} # IO => DelayConnection, every open one
      @reading = {} # IO => DelayConnection waiting for a request
      @writing = {} # IO => DelayConnection with a partly written response
      @timers = TimerHeap.new
      @accept_paused_until = 0.0
      @stopping = false
    end

    # Serves until {#stop} is called, the lifeline closes, or a signal handler
    # calls {#stop}. Closes every socket before returning.
    #
    # @return [void]
    def run
      until @stopping
        readable, writable = IO.select(readers, @writing.keys, nil, select_timeout)
        woke_at = now
        readable&.each { |io| on_readable(io, woke_at) }
        writable&.each { |io| on_writable(io) }
        @timers.pop_due(now) { |connection| on_due(connection) }
      end
    ensure
      shut_down
    end

    # Makes {#run} return at its next wake-up. Safe to call from a trap.
    def stop
      @stopping = true
    end

    private

    def readers
      list = @reading.keys
      list << @listener if now >= @accept_paused_until
      list << @lifeline if @lifeline
      list
    end

    # Seconds until the next timer or the end of an accept pause; at most 1 s.
    def select_timeout
      current = now
      deadlines = [@timers.next_deadline]
      deadlines << @accept_paused_until if @accept_paused_until > current
      deadline = deadlines.compact.min
      deadline ? (deadline - current).clamp(0.0, 1.0) : 1.0
    end

    def on_readable(io, woke_at)
      return accept_connections if io.equal?(@listener)
      return stop if io.equal?(@lifeline)

      connection = @reading[io]
      return unless connection

      handle_parse(connection, connection.on_readable(woke_at))
    end

    def handle_parse(connection, result)
      case result
      when :request
        @reading.delete(connection.io)
        @timers.push(connection.due_at, connection)
      when :closed then forget(connection)
      end
    end

    def on_due(connection)
      return if connection.closed?

      finish_write(connection, connection.write_response)
    end

    def on_writable(io)
      connection = @writing.delete(io)
      finish_write(connection, connection.write_response) if connection
    end

    def finish_write(connection, result)
      case result
      when :partial then @writing[connection.io] = connection
      when :done
        @reading[connection.io] = connection
        handle_parse(connection, connection.parse_request(now))
      when :closed then forget(connection)
      end
    end

    def forget(connection)
      @connections.delete(connection.io)
      @reading.delete(connection.io)
      @writing.delete(connection.io)
    end

    def accept_connections
      ACCEPT_BATCH.times do
        socket = @listener.accept_nonblock(exception: false)
        return if socket == :wait_readable

        socket.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1)
        connection = DelayConnection.new(socket)
        @connections[socket] = connection
        @reading[socket] = connection
      end
    rescue Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM
      # Out of descriptors: leave the backlog alone for a moment rather than
      # spin; clients wait in the kernel's accept queue meanwhile.
      @accept_paused_until = now + ACCEPT_BACKOFF
    rescue Errno::ECONNABORTED, Errno::EPROTO
      nil # the client gave up before we accepted; nothing to serve
    end

    def shut_down
      @connections.each_value(&:close_now)
      @connections.clear
      @reading.clear
      @writing.clear
      @listener.close unless @listener.closed?
    end

    def now
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end
