# frozen_string_literal: true

require "socket"
require "io/wait"
require_relative "../llhttp_pin"

module NeverBlock
  class ReverseProxy
    # One keep-alive HTTP/1.1 connection to the upstream: writes a request,
    # parses the response with llhttp and hands out its body as it arrives.
    # Used by one request at a time (the pool lends it).
    class UpstreamConnection < LLHttp::Delegate
      # The upstream closed the connection before a complete response.
      class Closed < IOError; end

      # A connect, read or write took longer than allowed.
      class Timeout < StandardError; end

      # The upstream's bytes are not valid HTTP/1.1.
      class BadResponse < StandardError; end

      READ_SIZE = 16 * 1024
      private_constant :READ_SIZE

      # Opens a connection.
      # @return [UpstreamConnection]
      # @raise [Timeout] when connecting takes longer than `connect_timeout`.
      # @raise [SystemCallError] when the upstream refuses or cannot be reached.
      def self.open(host, port, connect_timeout, timeout)
        socket = Socket.tcp(host, port, connect_timeout: connect_timeout)
        socket.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1)
        new(socket, timeout)
      rescue Errno::ETIMEDOUT
        raise Timeout, "connecting to #{host}:#{port} took over #{connect_timeout} s"
      end

      # @param socket [Socket]
      # @param timeout [Numeric] seconds any one read or write may wait.
      def initialize(socket, timeout)
        super()
        @socket = socket
        @timeout = timeout
        @used = false
        @buffer = String.new(capacity: READ_SIZE, encoding: Encoding::BINARY)
        @parser = LLHttp::Parser.new(self, type: :response)
        @complete = true
      end

      # @return [Boolean] whether a request went over it before.
      def used?
        @used
      end

      # Whether it can carry another request: the last response was read to
      # its end, the upstream keeps it alive and has not closed it since.
      # @return [Boolean]
      def reusable?
        @complete && @keep_alive && !@socket.closed?
      end

      # Whether an idle connection still looks open (no EOF or stray bytes
      # waiting on it); checked before it is lent again.
      # @return [Boolean]
      def healthy?
        return false unless reusable?

        @socket.read_nonblock(1, exception: false) == :wait_readable
      rescue IOError, SystemCallError
        false
      end

      # Sends a request and reads the response's head.
      # @param request_head [String] request line and headers, each ending
      #   in CRLF, without the blank line and without framing headers.
      # @param body [Array(#read, Integer), Array(#read, nil), nil] the
      #   body: its input and length, or its input to send chunked.
      # @param head [Boolean] whether it is a HEAD request (no body follows).
      # @return [Array(Integer, Hash{String => String, Array<String>})] the
      #   status and the headers (lowercase names; repeated ones as an Array).
      # @raise [Closed] when the upstream closes before answering.
      def exchange(request_head, body, head: false)
        @used = true
        start_response(head)
        write_request(request_head, body)
        wait_for_bytes # the answer cannot have come yet: a read now would find nothing
        feed until @headers_done
        [@status, @headers]
      end

      # Yields the body's chunks as they arrive, until it is complete.
      # @yieldparam chunk [String]
      # @return [void]
      def each_body_chunk
        loop do
          until @chunks.empty?
            yield @chunks.shift
          end
          break if @complete

          feed
        end
      end

      # @return [void]
      def close
        @socket.close unless @socket.closed?
      end

      # llhttp callbacks -----------------------------------------------------

      # @api private
      # (Defined so that llhttp calls back on a message's start; the work is
      # in internal_on_message_begin, whose result llhttp uses.)
      def on_message_begin; end

      # @api private
      def on_status(text)
        @status_text << text
      end

      # @api private
      def on_header_field(text)
        @field << text
      end

      # @api private
      def on_header_field_complete
        @name = @field.downcase
        @field = +""
      end

      # @api private
      def on_header_value(text)
        @value << text
      end

      # @api private
      def on_header_value_complete
        value = @value
        @value = +""
        existing = @headers[@name]
        @headers[@name] = if existing.nil? then value
                          elsif existing.is_a?(Array) then existing << value
                          else [existing, value]
                          end
      end

      # @api private
      # (Defined so that llhttp calls back on the end of the headers; the
      # work is in internal_on_headers_complete, whose result llhttp uses.)
      def on_headers_complete; end

      # @api private
      def on_body(chunk)
        @chunks << chunk
      end

      # @api private
      def on_message_complete
        if @interim
          @interim = false # a 1xx before the real response: start over
          start_response(@head)
          return
        end
        @keep_alive = @parser.keep_alive?
        @complete = true
      end

      private

      # A message that begins after the response is complete is bytes the
      # upstream sent beyond the response's framing (a wrong Content-Length,
      # say), read together with it. They belong to no request: parsing stops
      # there (-1), before they can add headers or body to the response, and
      # the connection, whose next bytes can no longer be trusted, is closed
      # instead of reused.
      def internal_on_message_begin
        return 0 unless @complete

        @stray = true
        @keep_alive = false
        -1
      end

      # The status and headers are known: a 1xx (not 101) is skipped; for a
      # HEAD request, returning 1 tells llhttp that no body follows.
      def internal_on_headers_complete
        @status = @parser.status_code
        if @status >= 100 && @status < 200 && @status != 101
          @interim = true
          return 0
        end
        @headers_done = true
        @keep_alive = @parser.keep_alive?
        @head ? 1 : 0
      rescue StandardError
        -1
      end

      def start_response(head)
        @head = head
        @status = nil
        @status_text = +""
        @headers = {}
        @field = +""
        @value = +""
        @name = nil
        @chunks = []
        @headers_done = false
        @complete = false
        @interim = false
        @keep_alive = false
        @stray = false
      end

      def write_request(head, body)
        if body.nil?
          write("#{head}\r\n")
        elsif body[1]
          input, length = body
          write("#{head}content-length: #{length}\r\n\r\n")
          copy(input, length)
        else
          write("#{head}transfer-encoding: chunked\r\n\r\n")
          input = body[0]
          while (data = input.read(READ_SIZE))
            write("#{data.bytesize.to_s(16)}\r\n#{data}\r\n") unless data.empty?
          end
          write("0\r\n\r\n")
        end
      end

      def copy(input, length)
        remaining = length
        while remaining.positive?
          data = input.read([remaining, READ_SIZE].min) or raise IOError, "request body shorter than its Content-Length"
          write(data)
          remaining -= data.bytesize
        end
      end

      def write(data)
        data = data.b
        until data.empty?
          written = @socket.write_nonblock(data, exception: false)
          if written == :wait_writable
            @socket.wait_writable(@timeout) or raise Timeout, "writing the request took over #{@timeout} s"
          else
            data = data.byteslice(written..)
          end
        end
      end

      # Waits until the upstream sends something (or closes), for at most the timeout.
      # @raise [Timeout]
      def wait_for_bytes
        @socket.wait_readable(@timeout) or raise Timeout, "no response bytes for #{@timeout} s"
        nil
      end

      # Reads once and parses; EOF ends a body that runs until close, and is
      # otherwise a {Closed}.
      def feed
        data = @socket.read_nonblock(READ_SIZE, @buffer, exception: false)
        return wait_for_bytes if data == :wait_readable

        if data.nil?
          finish_at_eof
        else
          @parser << data
        end
      rescue LLHttp::Error => e
        @keep_alive = false
        raise BadResponse, e.message unless @stray # (stray bytes after a complete response: it stands)
      end

      def finish_at_eof
        @keep_alive = false
        if @headers_done
          @parser.finish # completes a body that runs until the connection closes
          raise Closed, "the upstream closed the connection in the middle of the response body" unless @complete
        else
          raise Closed, "the upstream closed the connection before answering"
        end
      rescue LLHttp::Error
        raise Closed, "the upstream closed the connection in the middle of the response"
      end
    end
  end
end
