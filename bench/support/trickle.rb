# frozen_string_literal: true

require "socket"

module NeverBlockBench
  # Clients that each send `head`, then the block's bytes every `interval`
  # seconds, reconnecting when the server answers (the answer's status is
  # kept, with how long after the head it came) or closes, from new until #stop.
  class Trickle
    # @return [Array<String>] the statuses of the answers the trickled requests got
    attr_reader :answers

    # @return [Array<Float>] seconds from each answered request's head to its answer
    attr_reader :answered_after

    def initialize(port, count, head, interval, &drip)
      @port = port
      @head = head
      @interval = interval
      @drip = drip
      @stop = false
      @answers = []
      @answered_after = []
      @opened = {}
      @sockets = Array.new(count) { open }
      @thread = Thread.new { trickle until @stop }
    end

    # @return [Integer] connections still open when it stopped
    def stop
      @stop = true
      @thread.join
      @sockets.compact.reject(&:closed?).each(&:close).size
    end

    private

    def open
      Socket.tcp("127.0.0.1", @port, connect_timeout: 5).tap do |socket|
        socket.write(@head)
        @opened[socket] = NeverBlockBench.now
      end
    rescue SystemCallError, IOError
      nil
    end

    def trickle
      deadline = NeverBlockBench.now + @interval
      @sockets.map!.with_index do |socket, i|
        break @sockets if @stop

        socket = reopen(socket) if socket && answered?(socket)
        (socket ||= open)&.write_nonblock(@drip.call(i)) && socket
      rescue SystemCallError, IOError
        reopen(socket)
      end
      remaining = deadline - NeverBlockBench.now
      sleep(remaining) if remaining.positive? && !@stop
    end

    # Whether the server answered or closed it (a status it sent is kept).
    def answered?(socket)
      data = socket.read_nonblock(4096, exception: false)
      return false if data == :wait_readable

      if data && (status = data[%r{\AHTTP/1\.[01] (\d{3})}, 1])
        @answers << status
        @answered_after << NeverBlockBench.now - @opened[socket]
      end
      true
    end

    def reopen(socket)
      if socket
        @opened.delete(socket)
        socket.close
      end
      open
    end
  end
end
