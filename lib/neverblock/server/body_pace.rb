# frozen_string_literal: true

module NeverBlock
  class Server
    # How long a {Connection} may still wait for the body of the request it
    # is reading: the clock of one body, from the end of its head (the
    # connection reads bodies holding no request slot, so a slow body
    # delays no other request; this bounds what it costs its connection).
    # Called only by Connection#read_body, before each wait on the socket.
    #
    # Three limits, the nearest wins ({Limits}):
    # - `body_timeout` :: seconds the body may make no progress at all;
    # - `min_body_rate` :: bytes per second the body must average over each
    #   window of `body_timeout` seconds, counted from the end of its head
    #   (a body that sends at least `min_body_rate × body_timeout` bytes in
    #   a window starts the next one; one that sends fewer is refused when
    #   the window ends). A trickle of a byte every few seconds (slowloris
    #   on the body) ends within one window, while an upload over a slow
    #   mobile link (a few KB/s) goes on for as long as it takes. 0: off;
    # - `request_timeout` :: the request's deadline, when set: the body must
    #   be in by then ({Request#head_at} + `request_timeout`).
    #
    # Past any of them the connection answers 408 with the message {#expired}
    # gives and closes.
    class BodyPace
      # @param limits [Limits]
      def initialize(limits)
        @timeout = limits.body_timeout
        @window_bytes = limits.min_body_rate * limits.body_timeout
        @request_timeout = limits.request_timeout
        @rate = limits.min_body_rate
        @request = nil
      end

      # Starts the clock for `request`'s body, unless it runs for it already.
      # @param request [Request] the request whose body is read now.
      # @param now [Float] monotonic seconds.
      # @return [void]
      def start(request, now)
        return if request.equal?(@request)

        @request = request
        @progress_at = now # the last read that brought bytes
        @window_end = now + @timeout
        @window_read = 0 # bytes read in the current window
        @deadline = (request.head_at + @request_timeout if @request_timeout && request.head_at)
      end

      # Counts bytes just read.
      # @param bytes [Integer]
      # @param now [Float] monotonic seconds.
      # @return [void]
      def read(bytes, now)
        @progress_at = now
        @window_read += bytes
      end

      # @param now [Float] monotonic seconds.
      # @return [Float] seconds the connection may wait for more of the body
      #   (zero or less: it waited long enough, see {#expired}).
      def wait(now)
        roll(now)
        left = @progress_at + @timeout - now
        left = @window_end - now if @window_read < @window_bytes && @window_end - now < left
        left = @deadline - now if @deadline && @deadline - now < left
        left
      end

      # @param now [Float] monotonic seconds, past {#wait}.
      # @return [String] why the body is refused (for the 408's log line).
      def expired(now)
        if @deadline && now >= @deadline
          "request body not complete within request_timeout #{@request_timeout} s of its head"
        elsif now >= @progress_at + @timeout
          "no request body for #{@timeout} s"
        else
          "request body slower than min_body_rate #{@rate} bytes/s (#{@window_read} bytes in #{@timeout} s)"
        end
      end

      private

      # A window that ended with enough bytes read starts the next one, now
      # (a client that sent without pause for several windows is looked at
      # only when the connection next waits for it).
      def roll(now)
        return unless @window_bytes.positive? && now >= @window_end && @window_read >= @window_bytes

        @window_end = now + @timeout
        @window_read = 0
      end
    end
  end
end
