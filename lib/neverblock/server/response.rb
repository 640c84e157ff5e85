# frozen_string_literal: true

require "time"
require_relative "stream"

module NeverBlock
  class Server
    # Writes responses to one client socket: the status line and headers,
    # the body framed by Content-Length or chunked encoding, interim
    # `100 Continue`s and the server's own error responses.
    #
    # Writes never wait longer than `write_timeout` for a client that stopped
    # reading; a client that went away raises {ClientGone}, which the
    # connection treats as a normal end, without logging.
    class Response
      # Reason phrases for the status line (any phrase is valid HTTP; these read well).
      REASONS = {
        100 => "Continue", 101 => "Switching Protocols", 103 => "Early Hints",
        200 => "OK", 201 => "Created", 202 => "Accepted", 204 => "No Content", 206 => "Partial Content",
        301 => "Moved Permanently", 302 => "Found", 303 => "See Other", 304 => "Not Modified",
        307 => "Temporary Redirect", 308 => "Permanent Redirect",
        400 => "Bad Request", 401 => "Unauthorized", 403 => "Forbidden", 404 => "Not Found",
        405 => "Method Not Allowed", 408 => "Request Timeout", 409 => "Conflict", 410 => "Gone",
        411 => "Length Required", 412 => "Precondition Failed", 413 => "Content Too Large",
        414 => "URI Too Long", 415 => "Unsupported Media Type", 417 => "Expectation Failed",
        422 => "Unprocessable Content", 426 => "Upgrade Required", 429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error", 501 => "Not Implemented", 502 => "Bad Gateway",
        503 => "Service Unavailable", 504 => "Gateway Timeout", 505 => "HTTP Version Not Supported"
      }.freeze

      STATUS_LINES = Hash.new { |hash, status| hash[status] = "HTTP/1.1 #{status} #{REASONS.fetch(status, 'Status')}\r\n".b.freeze }
      private_constant :STATUS_LINES

      # Socket errors that mean the client is gone.
      GONE = [Errno::EPIPE, Errno::ECONNRESET, Errno::ENOTCONN, Errno::ETIMEDOUT, Errno::ECONNABORTED,
              IOError].freeze

      # Bodies up to this size are sent in the same write as the headers.
      COALESCE = 64 * 1024
      # Bytes a response's head (with a small body, see COALESCE) is made
      # room for at once, by the C extension (HTTPHead.head_buffer). On Ruby
      # 3.2+ a String of this capacity is held in its object's own slot
      # (Variable Width Allocation): a hello-world response then costs no
      # malloc, no realloc as it grows, and no free when it is swept (about
      # 500 instructions a response on Ruby 3.4 + YJIT). A longer head moves
      # to the heap as it grows, as before.
      HEAD_CAPACITY = 512

      # The end of a chunked body.
      LAST_CHUNK = "0\r\n\r\n"
      private_constant :LAST_CHUNK

      # Each chunk's size line (hex, CRLF) for the small chunks events and
      # tokens come in: a streamed event allocates nothing for it.
      SIZE_LINES = Array.new(1024) { |size| "#{size.to_s(16)}\r\n".freeze }.freeze
      private_constant :SIZE_LINES

      # The `content-length` headers the server added to array bodies, by
      # size, each made once (bodies under 16 KiB, most pages): a response
      # allocates no String for it. Filled as sizes come (two threads may
      # both make one: equal Strings, either kept).
      LENGTH_LINES = Array.new(16 * 1024)
      private_constant :LENGTH_LINES

      # @api private
      # `data` as one chunk of a chunked body, appended to `out` (or to a
      # new String sized for it).
      # @return [String] `out`
      def self.chunk(data, out = String.new("", capacity: data.bytesize + 8))
        size = data.bytesize
        out << (SIZE_LINES[size] || "#{size.to_s(16)}\r\n") << data << "\r\n"
      end

      # The client went away (or stopped reading) during a write.
      class ClientGone < BaseError
      end

      # The client stopped reading: a write waited `write_timeout` seconds.
      # Its connection is still open, so this is not a hang-up.
      class WriteTimedOut < ClientGone
      end

      # The response headers the server reads, by their byte size (each
      # size has one): a key of another size is never one of them, in any
      # case.
      FRAMING_NAMES = %w[date connection content-length transfer-encoding]
                      .each_with_object([]) { |name, names| names[name.bytesize] = name }.freeze
      private_constant :FRAMING_NAMES

      @date = nil
      @date_second = nil

      class << self
        # @return [String] the Date header line for the current second.
        def date_line
          second = Process.clock_gettime(Process::CLOCK_REALTIME, :second)
          return @date if second == @date_second

          @date_second = second
          @date = "date: #{Time.at(second).httpdate}\r\n".freeze
        end
      end

      # @return [Boolean] true once bytes of the current response were sent
      #   (an error can then no longer become a clean 500).
      attr_reader :started

      # @param value [Boolean] false at the start of a request whose app may
      #   be interrupted (request_timeout), so that the last response's
      #   bytes do not count as this one's.
      attr_writer :started

      # @return [Integer] body bytes of the last response (without chunk
      #   framing), for the access log.
      attr_reader :body_bytes

      # What the app's headers said (#add_headers, and HTTPHead.response_headers:
      # response_head.c's FLAG_*): a content-length header, a transfer-encoding
      # one, a date one, a connection one that says close.
      HEAD_LENGTH = 1
      HEAD_FRAMED = 2
      HEAD_DATED = 4
      HEAD_CLOSE = 8
      private_constant :HEAD_LENGTH, :HEAD_FRAMED, :HEAD_DATED, :HEAD_CLOSE

      # @param socket [IO]
      # @param write_timeout [Numeric] seconds
      # @param fast_headers [Boolean] whether the app's headers are written by
      #   the C extension (HTTPHead.response_headers, into a head made by
      #   HTTPHead.head_buffer) where it can: the
      #   server's head_parser switch, which turns both C paths on or off.
      def initialize(socket, write_timeout, fast_headers = false)
        @socket = socket
        @write_timeout = write_timeout
        @started = false
        @body_bytes = 0
        @fast_headers = fast_headers && HTTPHead.respond_to?(:head_buffer)
        @values = [nil] # the content-length header's value, put here by #add_headers or the C walk
      end

      # Sends `HTTP/1.1 100 Continue`.
      # @return [void]
      def write_continue
        write_all("HTTP/1.1 100 Continue\r\n\r\n")
      end

      # A header name: an HTTP token (RFC 9110).
      TOKEN = /\A[!#$%&'*+\-.^_`|~0-9A-Za-z]+\z/
      private_constant :TOKEN

      # Sends `103 Early Hints` with `headers` (Rack 3's `rack.early_hints`).
      # Nothing is written unless every name is an HTTP token and every value
      # (a String, or an Array of them: one line each) is free of CR, LF and
      # NUL: a hint cannot split the response. Once written whole, it does
      # not count as the start of the response ({#started}): the final
      # response may still be an error.
      # @param headers [Hash{String => String, Array<String>}]
      # @return [void]
      # @raise [ArgumentError] for an invalid name or value, before writing.
      # @raise [ClientGone]
      def write_early_hints(headers)
        raise ArgumentError, "rack.early_hints takes a Hash of headers, got #{headers.class}" unless headers.is_a?(Hash)

        hints = +"HTTP/1.1 103 Early Hints\r\n"
        headers.each do |name, values|
          unless name.is_a?(String) && name.match?(TOKEN)
            raise ArgumentError, "rack.early_hints: invalid header name #{name.inspect}"
          end

          Array(values).each do |value|
            unless value.is_a?(String) && !value.match?(/[\r\n\0]/)
              raise ArgumentError, "rack.early_hints: invalid value for #{name}: #{value.inspect} (a String without CR, LF or NUL)"
            end

            hints << name << ": " << value << "\r\n"
          end
        end
        started = @started
        write_all(hints << "\r\n")
        @started = started # a whole 103 is not the response's start (one cut short by an error is)
      end

      # Sends one of the server's own responses (an error) and asks for the
      # connection to be closed unless `keep_alive`.
      # @param head [Boolean] it answers a HEAD request: no body follows the
      #   headers (one would be read as the start of the next response).
      # @param retry_after [Integer, nil] seconds, sent as Retry-After.
      # @return [void]
      def write_error(status, keep_alive: false, head: false, retry_after: nil)
        text = "#{REASONS.fetch(status, 'Error')}\n"
        @body_bytes = head ? 0 : text.bytesize
        write_all("#{STATUS_LINES[status]}content-type: text/plain\r\ncontent-length: #{text.bytesize}\r\n" \
                  "#{"retry-after: #{retry_after}\r\n" if retry_after}" \
                  "#{self.class.date_line}#{keep_alive ? '' : "connection: close\r\n"}\r\n#{head ? '' : text}")
      end

      # Sends an app's response and closes its body.
      #
      # @param request [Request]
      # @param keep_alive [Boolean] whether the connection may stay open as far
      #   as the request and the server are concerned.
      # @return [Boolean] whether it may stay open after this response (the
      #   app did not ask to close, and the body's end was framed).
      # @raise [ClientGone]
      def write(request, status, headers, body, keep_alive)
        @started = false
        @body_bytes = 0
        @overflow = false
        status = status.to_i
        no_body = request.head || status < 200 || status == 204 || status == 304
        if @fast_headers
          head = HTTPHead.head_buffer(STATUS_LINES[status], HEAD_CAPACITY)
        else
          head = +""
          head << STATUS_LINES[status]
        end
        # The app's header lines, in C where the extension can write them as
        # #add_headers does (ext/neverblock/http_head/response_head.c), else by #add_headers.
        flags = (@fast_headers && HTTPHead.response_headers(head, headers, @values)) ||
                add_headers(head, headers)
        length = nil
        if flags.anybits?(HEAD_LENGTH)
          length = @values[0]
          @values[0] = nil
        end
        framed_by_app = flags.anybits?(HEAD_FRAMED)
        dated = flags.anybits?(HEAD_DATED)
        keep_alive = false if flags.anybits?(HEAD_CLOSE)
        head << self.class.date_line unless dated

        if no_body
          head << connection_header(keep_alive, request)
          write_all(head << "\r\n")
          return keep_alive
        end

        if body.respond_to?(:to_ary)
          parts = body.to_ary
          # Summed once: length, the check below, write_parts (one part, most bodies: no block).
          parts_bytes = parts.size == 1 ? parts[0].bytesize : parts.sum(&:bytesize)
        end
        if length || framed_by_app
          chunked = false
        elsif parts
          length = parts_bytes
          head << length_line(length)
        elsif request.http10
          keep_alive = false # the body ends when the connection closes
          chunked = false
        else
          chunked = true
          head << "transfer-encoding: chunked\r\n"
        end
        head << connection_header(keep_alive, request) << "\r\n"

        declared = declared_length(length) unless framed_by_app
        if parts && (declared.nil? || declared == parts_bytes)
          write_parts(head, parts, parts_bytes)
        elsif parts
          write_each(head, parts, false, declared) # cut at the declared length
        elsif body.respond_to?(:each)
          write_each(head, body, chunked, declared)
        else
          write_stream(head, body, chunked, request)
        end
        # A body that does not match its Content-Length would put the client
        # out of step with the next response: this connection ends here.
        keep_alive && (declared.nil? || (declared == @body_bytes && !@overflow))
      end

      # Sends the status line and the app's headers (with a Date), and nothing
      # else: no framing, no Connection header. For a partial hijack, after
      # which the app writes to the socket itself.
      # @return [void]
      # @raise [ClientGone]
      def write_head(status, headers)
        @started = false
        @body_bytes = 0
        head = +""
        head << STATUS_LINES[status.to_i]
        headers.each { |key, value| add_header(head, key, value) unless key.start_with?("rack.") }
        head << self.class.date_line unless headers.each_key.any? { |key| key.casecmp?("date") }
        write_all(head << "\r\n")
      end

      # @api private
      # Counts body bytes a {Stream} sent.
      # @return [void]
      def sent_body(bytes)
        @body_bytes += bytes
      end

      # @api private
      # Writes every byte, waiting at most `write_timeout` for the client.
      # @raise [ClientGone]
      def write_all(data)
        @started = true
        socket = @socket
        until (written = socket.write_nonblock(data, exception: false)) == data.bytesize
          if written == :wait_writable
            raise WriteTimedOut, "write timed out" unless socket.wait_writable(@write_timeout)
          else
            data = data.byteslice(written, data.bytesize - written)
          end
        end
      rescue *GONE => e
        raise ClientGone, e.message
      end

      private

      def connection_header(keep_alive, request)
        if !keep_alive
          "connection: close\r\n"
        elsif request.http10
          "connection: keep-alive\r\n"
        else
          ""
        end
      end

      # Appends a line for each of the app's `headers` but the server's own
      # (`rack.`) and `connection`, and tells what the framing headers said.
      # @return [Integer] HEAD_* bits; a content-length header's value is put
      #   in @values[0].
      def add_headers(head, headers)
        flags = 0
        headers.each do |key, value|
          next if key.start_with?("rack.") # for the server (rack.hijack, rack.protocol), not the client

          name = key
          # A Rack 2 app may name them in any case ("Content-Length"): Rack 3's are lowercase.
          if (framing = FRAMING_NAMES[key.bytesize]) && !key.equal?(framing) && key.casecmp?(framing)
            name = framing
          end
          case name
          when "content-length"
            flags |= HEAD_LENGTH
            @values[0] = value
          when "transfer-encoding" then flags |= HEAD_FRAMED
          when "date" then flags |= HEAD_DATED
          when "connection"
            flags |= HEAD_CLOSE if value.to_s.downcase.include?("close")
            next
          end
          add_header(head, key, value)
        end
        flags
      end

      # Values are Strings or Arrays of Strings (Rack 3); a newline inside a
      # value would split the response, so it starts a new header line instead.
      # A name with CR, LF or NUL (Rack::Lint refuses one; an app that makes
      # names from what a client sent could have one) is left out, as Puma
      # leaves it out: written, it would split the response.
      # Checked with include? rather than a regex: no Onigmo match (and its
      # stack) per header of every response (see Parser).
      def add_header(head, key, value)
        return if key.include?("\n") || key.include?("\r") || key.include?("\0")

        if value.is_a?(Array)
          value.each { |item| add_header(head, key, item) }
        elsif (value = value.to_s).include?("\n") || value.include?("\r")
          value.split(/[\r\n]+/).each { |line| head << key << ": " << line << "\r\n" }
        else
          head << key << ": " << value << "\r\n"
        end
      end

      def write_parts(head, parts, bytes)
        @body_bytes = bytes
        if bytes <= COALESCE
          parts.each { |part| head << part }
          write_all(head)
        else
          write_all(head)
          parts.each { |part| write_all(part) unless part.empty? }
        end
      end

      # With a declared length, bytes past it are not sent (the connection
      # is then closed, see {#write}). The head goes out with the first
      # chunk; what is left to write at the end (the head of an empty body,
      # the last chunk's marker) in one more write.
      def write_each(head, body, chunked, declared = nil)
        pending = head
        sent = 0
        body.each do |chunk|
          next if chunk.empty?

          if declared && sent + chunk.bytesize > declared
            @overflow = true
            next if sent >= declared

            chunk = chunk.byteslice(0, declared - sent)
          end
          sent += chunk.bytesize
          @body_bytes += chunk.bytesize
          if chunked
            pending ? write_all(Response.chunk(chunk, pending)) : write_chunk(chunk)
          else
            write_all(pending ? pending << chunk : chunk)
          end
          pending = nil
        end
        pending = pending ? pending << LAST_CHUNK : LAST_CHUNK if chunked
        write_all(pending) if pending
      end

      # Chunks up to this many bytes are framed in the response's one buffer.
      CHUNK_BUFFER_MAX = 16 * 1024

      # Writes one chunk of a body written with `each`, framed in one String
      # the response keeps and empties after each write: an event stream's
      # chunk is small and frequent, and a String made for each (and the Hash
      # of its capacity: keyword) were two of the five or so objects an event
      # cost, which at thousands of streams drove the minor GCs that scan
      # every stream's fiber stack. #write_all keeps no reference to it. A
      # large chunk, or one written while another fiber's write is using the
      # buffer (an app that yields from two fibers), gets a String of its own.
      def write_chunk(chunk)
        buffer = (@chunk_buffer ||= +"")
        return write_all(Response.chunk(chunk)) unless buffer.empty? && chunk.bytesize <= CHUNK_BUFFER_MAX

        begin
          write_all(Response.chunk(chunk, buffer))
        ensure
          buffer.clear
        end
      end

      # @return [String] the `content-length` header of a body of `length` bytes.
      def length_line(length)
        return "content-length: #{length}\r\n" if length >= LENGTH_LINES.size

        LENGTH_LINES[length] ||= "content-length: #{length}\r\n".freeze
      end

      # @return [Integer, nil] the app's Content-Length, nil when it has none
      #   or one that is not a plain number.
      def declared_length(value)
        return value if value.is_a?(Integer) # (the server's own length, or a Rack 2 app's Integer: no String made and parsed)

        value && Integer(value.to_s, 10)
      rescue ArgumentError
        nil
      end

      # A response given up on before the body closed its stream (the
      # request timed out, its client hung up, the server stopped) takes no
      # more writes: the last chunk, which the app's `ensure` would write as
      # its writer task is cancelled, would make a cut response look whole.
      def write_stream(head, body, chunked, request)
        stream = Stream.new(self, head, chunked, request.env["rack.input"])
        body.call(stream)
        stream.wait_closed
      ensure
        stream&.abandon
      end
    end
  end
end
