# frozen_string_literal: true

module NeverBlock
  class Server
    # The stream handed to a streaming body's `call(stream)` (Rack 3). Writes
    # go to the client (chunked when the response has no Content-Length);
    # reads come from the request body. The response ends when the body
    # closes the stream, which it may do from another fiber after `call`
    # returned.
    #
    # A write that fails because the client went away raises
    # {Response::ClientGone} in the writer, and every write after it too;
    # the response then ends at once (the connection's fiber, waiting for
    # the close in {#wait_closed}, raises it: see {StreamedResponse}). A task
    # of the app's that ends with that error is not reported as an unhandled
    # failure: the request is logged once, as a hang-up.
    class Stream
      # @api private
      def initialize(response, head, chunked, input)
        @response = response
        @head = head
        @chunked = chunked
        @input = input
        @closed = false
        @gone = nil # the Response::ClientGone of the write that failed
        @done = Thread::Queue.new
      end

      # @return [String, nil] from the request body.
      def read(length = nil, buffer = nil)
        @input.read(length, buffer)
      end

      # Sends `data` to the client now.
      # @return [Integer] bytes accepted.
      # @raise [IOError] after {#close}; [Response::ClientGone] when the client left.
      def write(data)
        raise @gone.class, @gone.message if @gone
        raise IOError, "stream closed" if @closed

        data = data.to_s
        return 0 if data.empty?

        if @chunked
          out = @head ? Response.chunk(data, +@head) : Response.chunk(data)
        else
          out = @head ? @head + data : data
        end
        @head = nil
        deliver(out)
        @response.sent_body(data.bytesize)
        data.bytesize
      end

      # @return [self]
      def <<(data)
        write(data)
        self
      end

      # Writes are not buffered: nothing to do.
      # @return [self]
      def flush
        self
      end

      # No more request body for the app.
      # @return [void]
      def close_read
        nil
      end

      # Ends the response.
      # @return [void]
      def close_write
        close
      end

      # Ends the response: the last chunk goes out, and the connection moves
      # on to the next request.
      # @return [void]
      def close
        return if @closed

        @closed = true
        tail = @head ? @head.dup : +""
        @head = nil
        tail << "0\r\n\r\n" if @chunked
        deliver(tail) unless tail.empty? || @gone
      ensure
        @done.push(true) if @done.empty?
      end

      # @return [Boolean]
      def closed?
        @closed
      end

      # @api private
      # Waits (this fiber only) until the body has closed the stream, or a
      # write to it failed.
      # @return [void]
      # @raise [Response::ClientGone] a write failed: the client went away.
      def wait_closed
        @done.pop
        raise @gone.class, @gone.message if @gone
      end

      # @api private
      # The response is over (Response#write_stream): a stream the body has
      # not closed is closed without its last chunk, and takes no more
      # writes ({#write} raises IOError).
      # @return [void]
      def abandon
        @closed = true
      end

      private

      # Writes to the client; a failure ends the response (see the class comment).
      def deliver(bytes)
        @response.write_all(bytes)
      rescue Response::ClientGone => e
        @gone ||= e
        Task.current&.observe!
        @done.push(true) if @done.empty?
        raise
      end
    end
  end
end
