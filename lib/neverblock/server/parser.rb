# frozen_string_literal: true

require "ipaddr"

begin
  require "llhttp"
rescue LoadError => e
  raise LoadError, "NeverBlock::Server parses HTTP with the llhttp gem: add `gem \"llhttp\", \"~> 0.6\"` " \
                   "to your Gemfile (#{e.message})"
end
begin
  require "neverblock/http_head"
rescue LoadError
  nil # not compiled (a `path:` gem): every head goes through llhttp's callbacks (see Parser.head_parser?)
end

module NeverBlock
  class Server
    # Turns the bytes of one connection into {Request}s: llhttp (in its
    # strict mode, which rejects the request-smuggling shapes: Content-Length
    # with Transfer-Encoding, duplicate or invalid Content-Length, bare CR/LF
    # in headers, NUL or CTL in the target) parses the heads, and the Parser
    # enforces the {Limits} llhttp has no notion of.
    #
    # The Parser, not llhttp, frames every body, so it always knows where a
    # message ends: llhttp is given the bytes of one head, up to its empty
    # line, and nothing after it. A Content-Length body is then read here
    # (#take_body), a chunked one by {ChunkedBody}, which refuses the chunk
    # framing llhttp 8.1 lets through (chunk data not followed by CRLF), and
    # llhttp is reset for the next head. Pipelined requests pile up in
    # {#requests} in order; the connection answers them and reads again
    # only when the queue is drained.
    #
    # Errors: {#<<} raises {HTTPError} with the status to answer; status nil
    # after an Upgrade or CONNECT request, which ends the HTTP exchange (the
    # connection serves it and stops reading; bytes sent after it, before
    # its response, are refused with 400: a hijacked socket is a plain IO
    # and they could not be handed to the app).
    #
    # The fast path: at a message boundary the bytes go first to
    # {NeverBlock::HTTPHead} (ext/neverblock/http_head), which builds the
    # env of a plain, complete, kept-alive head in C and declines anything
    # else; what it declines goes to llhttp as above, from that boundary. It
    # gives the env llhttp's callbacks would
    # (test/neverblock/server/head_parser_test.rb compares them). Without the
    # extension, or with `NEVERBLOCK_HEAD_PARSER=off`, every head goes
    # through llhttp.
    class Parser < LLHttp::Delegate
      # The environment variable that turns the C fast path off (`off`).
      HEAD_PARSER_SWITCH = "NEVERBLOCK_HEAD_PARSER"

      # llhttp error names mapped to statuses other than 400.
      STATUSES = { "HPE_PAUSED_H2_UPGRADE" => 505, "HPE_INVALID_VERSION" => 505 }.freeze

      # Not a single regex match runs per ordinary request: a match, here
      # inside llhttp's callbacks, takes Onigmo's ~6 KiB alloca stack and
      # deepens every connection fiber's stack by a page, which each idle
      # keep-alive connection then keeps (40 MB per 10,000 connections).

      # RFC 3986 host (a reg-name, `%` only as a `%XX` escape; or an IPv6
      # literal, checked further by {#ipv6?}) with an optional port, as
      # Rack::Lint wants HTTP_HOST.
      HOST = /\A(?:\[[0-9A-Fa-f:.]+\]|(?:%\h\h|[A-Za-z0-9\-._~!$&'()*+,;=])+)(?::\d*)?\z/

      # The end of a head (strict llhttp takes no bare LF as a line end).
      HEAD_END = "\r\n\r\n"

      HTTP_KEYS = {} # rubocop:disable Style/MutableConstant -- a bounded cache
      private_constant :HTTP_KEYS, :HEAD_END

      # @return [Array<Request>] requests whose headers are complete, oldest first.
      attr_reader :requests

      # @return [Boolean] whether parsers take the C fast path: the extension
      #   is built and {HEAD_PARSER_SWITCH} is not `off`.
      def self.head_parser?
        defined?(NeverBlock::HTTPHead) && ENV[HEAD_PARSER_SWITCH] != "off" ? true : false
      end

      # @param limits [Limits]
      # @param base_env [Hash] the connection's env entries (REMOTE_ADDR, rack.errors, ...).
      # @param default_host [String], default_port [String] for a request without Host.
      # @param head_parser [Boolean] whether to take the C fast path ({.head_parser?}).
      def initialize(limits, base_env, default_host, default_port, head_parser = Parser.head_parser?)
        super()
        @limits = limits
        @base_env = base_env
        @default_host = default_host
        @default_port = default_port
        @requests = []
        @current = nil
        @in_message = false
        @closed = false      # a request not kept alive was read: nothing after it is
        @head_ending = false # llhttp is given the CRLF that ends a head
        @head_tail = nil     # the last bytes of a head that spans reads, to find its end
        @value_fragments = 0
        @line_ended = false
        @host = nil # the last Host seen on this connection, already checked
        @server_name = nil
        @server_port = nil
        @timed = !limits.request_timeout.nil? # requests need their head's time
        @llhttp = LLHttp::Parser.new(self, type: :request)
        @head = (HTTPHead.new(base_env, default_host, default_port, limits.max_request_target, limits.max_header_bytes,
                              limits.max_headers, limits.max_body) if head_parser)
        @body_left = 0   # bytes of the current request's Content-Length body still to come
        @chunked = nil   # the current request's ChunkedBody, while it is read
        @upgrade = false # the current request upgrades once its body is read
      end

      # Parses `data`; complete requests are appended to {#requests}.
      # @raise [HTTPError] for a request to refuse (after the requests before it).
      # @return [void]
      def <<(data)
        data = data.b unless data.encoding == Encoding::BINARY
        if @current && !@current.complete && (@raw_body += data.bytesize) > @limits.max_body + 65_536
          fail_with(413, "request body (with chunk framing) over #{@limits.max_body} bytes")
        end
        offset = 0
        size = data.bytesize
        head = @head
        while offset < size && !@closed
          offset = if @chunked
                     take_chunks(data, offset)
                   elsif @body_left.positive?
                     take_body(data, offset)
                   elsif head && !@in_message && (env = head.parse(data, offset))
                     plain_request(env, data, head.head_end)
                   else
                     take_head(data, offset)
                   end
        end
      ensure
        flush_bodies # spooled bodies are written here, outside llhttp's callbacks
      end

      # @return [void]
      def flush_bodies
        @requests.each(&:flush_body)
        @current&.flush_body
      end
      private :flush_bodies

      # @return [Float] when the current message's first byte arrived (monotonic seconds).
      attr_reader :started_at

      # @return [Boolean] true while a message has begun but is not complete.
      def in_message?
        @in_message
      end

      # @return [Boolean] true while the current request's headers are done
      #   and its body is still being read.
      def in_body?
        !@current.nil? && !@current.complete
      end

      # --- llhttp callbacks ---------------------------------------------------

      def on_message_begin
        @started_at = Clock.now
        @in_message = true
        @url = nil
        @field = nil
        @value = nil
        @headers = @base_env.dup # the request's env: headers go straight into it
        @header_bytes = 0
        @header_count = 0
      end

      def on_url(fragment)
        @url ? @url << fragment : (@url = fragment)
        fail_with(414, "request target over #{@limits.max_request_target} bytes") if @url.bytesize > @limits.max_request_target
      end

      def on_header_field(fragment)
        @field ? @field << fragment : (@field = fragment)
        count_header_bytes(fragment)
      end

      # A value arrives in one fragment per read it spans. A second fragment
      # from the same read, or one after a read that ended at a line end,
      # is an obs-fold continuation line (`X: a\r\n b`), which llhttp
      # joins to the value: refused, as proxies may read it otherwise.
      def on_header_value(fragment)
        if @value
          fail_with(400, "obs-fold (a header line continued on the next line)") if @value_fragments.positive? || @line_ended
          @value << fragment
        else
          @value = fragment
        end
        @value_fragments += 1
        count_header_bytes(fragment)
      end

      # llhttp calls this after every value, empty ones included.
      def on_header_value_complete
        store_header
      end

      # Exceptions here become llhttp's HPE_CB_HEADERS_COMPLETE, so the chosen
      # status travels in @error (see {#fail_with}).
      def on_headers_complete
        fail_with(400, "a head not ended by an empty line (CRLF CRLF)") unless @head_ending
        @current = build_request
        @current.head_at = Clock.now if @timed
        @current.keep_alive = @llhttp.keep_alive?
        @url = @headers = nil # an idle connection keeps nothing of its last request
        @raw_body = 0
        @requests << @current
        0
      end

      # A request without a body: llhttp completes it right after its head.
      def on_message_complete
        finish_request(@current)
        @current = nil
        0
      end

      private

      # Gives llhttp the bytes of the current head from `offset`, up to its
      # end if it ends in `data`; once it does, readies the body's framing.
      # @return [Integer] the offset after what it took.
      def take_head(data, offset)
        unless @in_message
          # Empty lines before a request line are skipped, as llhttp would (RFC 9112 2.2).
          offset += 1 while (byte = data.getbyte(offset)) == 13 || byte == 10
          return offset if byte.nil?

          check_request_line(data, offset)
        end
        stop = head_end(data, offset)
        unless stop
          feed_head(offset.zero? ? data : data.byteslice(offset, data.bytesize - offset), data, nil)
          remember_tail(data, offset)
          return data.bytesize
        end

        # llhttp 8.1 also ends a head at `\r\n\n` and at `\r\n\r` and any
        # byte; NeverBlock only at `\r\n\r\n`. So the empty line's CRLF
        # (its LF alone, when its CR came in the last read) is fed on its
        # own, and the head must end there (#on_headers_complete).
        split = stop - 2 < offset ? offset : stop - 2
        feed_head(data.byteslice(offset, split - offset), data, nil) if split > offset
        @head_ending = true
        feed_head(data.byteslice(split, stop - split), data, stop)
        @head_ending = false
        @head_tail = nil
        start_body(@current) if @current # (nil when llhttp completed a request without a body)
        stop
      end

      # Gives llhttp `part` of `data`; `stop` is where the head ends in `data`
      # when `part` ends it.
      def feed_head(part, data, stop)
        @value_fragments = 0
        @llhttp << part
      rescue LLHttp::Error => e
        raise @error if @error

        name = e.message[/HPE_\w+/]
        upgrade(data, stop) if name == "HPE_PAUSED_UPGRADE" # (only ever at a head's end)
        raise HTTPError.new(STATUSES.fetch(name, 400), e.message)
      ensure
        @line_ended = part.end_with?("\n", "\r")
      end

      # llhttp 8.1 takes a request line ended by a bare LF, and more than one
      # space between its parts; a proxy may read either otherwise. Checked
      # when the line is whole in this read (a line split over reads is
      # left to llhttp).
      def check_request_line(data, offset)
        newline = data.index("\n", offset) or return
        return if data.getbyte(newline - 1) == 13 && data.byteslice(offset, newline - offset).count(" ") == 2

        fail_with(400, "request line not `METHOD SP target SP version CRLF`")
      end

      # @return [Integer, nil] the offset just after the current head's empty
      #   line, nil when it does not end in `data`.
      def head_end(data, offset)
        if (tail = @head_tail)
          spanning = (tail + data.byteslice(offset, 3)).index(HEAD_END)
          return offset + spanning + 4 - tail.bytesize if spanning
        end
        found = data.index(HEAD_END, offset)
        found && found + 4
      end

      # Keeps the last three bytes of the head so far: its end may span reads.
      def remember_tail(data, offset)
        size = data.bytesize
        tail = size - offset >= 3 || @head_tail.nil? ? data.byteslice(offset, size - offset) : @head_tail + data.byteslice(offset, size - offset)
        @head_tail = tail.bytesize > 3 ? tail.byteslice(tail.bytesize - 3, 3) : tail
      end

      # The head of `request` (llhttp's) is complete and a body follows:
      # llhttp, which now expects the body, is reset, and the body is framed
      # here (llhttp let a Transfer-Encoding through only when its last
      # coding is chunked, and never with Content-Length).
      def start_body(request)
        length = @llhttp.content_length
        @llhttp.reset
        env = request.env
        @upgrade = env.key?("HTTP_UPGRADE") && connection_upgrade?(env["HTTP_CONNECTION"])
        if env.key?("HTTP_TRANSFER_ENCODING")
          @chunked = ChunkedBody.new(@limits)
        else
          @body_left = length
        end
      end

      # Whether a Connection header lists `upgrade` (with Upgrade, llhttp
      # would pause after such a request's body).
      def connection_upgrade?(connection)
        connection&.split(",")&.any? { |token| token.strip.casecmp?("upgrade") } || false
      end

      # Queues the request {NeverBlock::HTTPHead} just parsed (what
      # #on_headers_complete and #build_request do for llhttp's), and takes
      # its body from `data` at `offset`.
      # @return [Integer] the offset after what it took.
      def plain_request(env, data, offset)
        head = @head
        request = Request.new(env, head.head?, head.http10?, @limits.max_body_in_memory)
        request.head_at = Clock.now if @timed
        request.keep_alive = true # the fast path takes only requests kept alive
        @requests << request
        length = head.content_length
        if length.zero?
          request.complete = true
          return offset
        end

        @current = request
        @in_message = true
        @raw_body = 0
        @body_left = length
        take_body(data, offset)
      end

      # Takes what `data` holds from `offset` on of the current request's
      # Content-Length body; the request is complete once all of it came.
      # @return [Integer] the offset after what it took.
      def take_body(data, offset)
        size = [@body_left, data.bytesize - offset].min
        append_body(@current, data.byteslice(offset, size)) if size.positive?
        return offset + size if (@body_left -= size).positive?

        body_read(data, offset + size)
      end

      # Takes what `data` holds from `offset` on of the current request's
      # chunked body ({ChunkedBody}).
      # @return [Integer] the offset after what it took.
      def take_chunks(data, offset)
        request = @current
        offset = @chunked.take(data, offset) { |bytes| append_body(request, bytes) }
        return offset unless @chunked.finished?

        @chunked = nil
        body_read(data, offset)
      end

      # @return [Integer] `offset`, where the next message starts.
      def body_read(data, offset)
        request = @current
        @current = nil
        finish_request(request)
        if @upgrade
          @upgrade = false
          upgrade(data, offset)
        end
        offset
      end

      # The request's message is complete: nothing read after one not kept alive.
      def finish_request(request)
        request.expects_continue = false
        request.complete = true
        @in_message = false
        @closed = true unless request.keep_alive
      end

      # Bodies over `max_body_in_memory` go to a Tempfile ({Request#append_body}).
      def append_body(request, bytes)
        if request.body_bytes + bytes.bytesize > @limits.max_body
          fail_with(413, "request body over #{@limits.max_body} bytes")
        end

        request.append_body(bytes)
      rescue SystemCallError, IOError => e
        NeverBlock.logger.error("NeverBlock::Server: could not write a request body to a Tempfile " \
                                "(#{Dir.tmpdir}): #{e.class}: #{e.message}")
        fail_with(500, "request body not stored: #{e.message}")
      end

      # CONNECT and `Connection: Upgrade` end the HTTP/1.1 exchange: the
      # connection serves the request (the last in {#requests}), then ends,
      # unless the app took the socket (rack.hijack). Bytes the client sent
      # after it, before its response (a WebSocket frame, say), were read from
      # the socket but cannot be handed to the app (a hijacked socket is a
      # plain IO): the request is refused with 400 rather than served with
      # some of its connection's bytes silently lost.
      # @param stop [Integer] where the request ended in `data`.
      # @raise [HTTPError] always: status nil ("serve, then close") or 400.
      def upgrade(data, stop)
        @requests.last.keep_alive = false
        @closed = true
        raise HTTPError.new(nil, "upgrade") if stop >= data.bytesize

        @requests.pop
        raise HTTPError.new(400, "bytes after an Upgrade/CONNECT request, sent before its response")
      end

      def fail_with(status, message)
        @error = HTTPError.new(status, message)
        raise @error
      end

      def count_header_bytes(fragment)
        return if (@header_bytes += fragment.bytesize + 4) <= @limits.max_header_bytes

        fail_with(431, "header block over #{@limits.max_header_bytes} bytes")
      end

      def store_header
        field = @field || +""
        value = @value || +""
        @field = @value = nil
        fail_with(431, "more than #{@limits.max_headers} headers") if (@header_count += 1) > @limits.max_headers
        # llhttp lets `Host : x` through, which a proxy might read differently: refused.
        fail_with(400, "whitespace in header name #{field.inspect}") if field.include?(" ") || field.include?("\t")
        fail_with(400, "empty header name") if field.empty?
        key = http_key(field)
        return unless key # a name with "_" could pose as one with "-": dropped, as Puma and nginx do
        return unless @headers # a trailer after a chunked body: counted above, not kept (see #on_headers_complete)

        value.strip!
        existing = @headers[key]
        @headers[key] = existing ? "#{existing}#{key == 'HTTP_COOKIE' ? '; ' : ', '}#{value}" : value
      end

      def http_key(field)
        key = HTTP_KEYS[field]
        return key if key
        return nil if field.include?("_")

        key = "HTTP_#{field.upcase.tr('-', '_')}".freeze
        key = "CONTENT_TYPE" if key == "HTTP_CONTENT_TYPE"
        key = "CONTENT_LENGTH" if key == "HTTP_CONTENT_LENGTH"
        HTTP_KEYS[field.dup.freeze] = key if HTTP_KEYS.size < 512
        key
      end

      def build_request
        llhttp = @llhttp
        fail_with(505, "HTTP/#{llhttp.http_major}.#{llhttp.http_minor}") unless llhttp.http_major == 1
        http10 = llhttp.http_minor.zero?
        method = llhttp.method_name
        content_length = @headers["CONTENT_LENGTH"]
        if (coding = @headers["HTTP_TRANSFER_ENCODING"])
          # llhttp ignores an empty Transfer-Encoding (and so its check against
          # Content-Length); RFC 9112 6.1: HTTP/1.0 framing with it is faulty.
          fail_with(400, "empty Transfer-Encoding") if coding.strip.empty?
          fail_with(400, "Transfer-Encoding in an HTTP/1.0 request") if llhttp.http_minor.zero?
        end
        if content_length && content_length.to_i > @limits.max_body
          fail_with(413, "Content-Length #{content_length} over #{@limits.max_body}")
        end

        env = @headers
        env["REQUEST_METHOD"] = method
        env["SERVER_PROTOCOL"] = http10 ? "HTTP/1.0" : "HTTP/1.1"
        env.delete(Connection::EARLY_HINTS) if http10 # 1xx responses are HTTP/1.1's (RFC 9110 15.2)
        set_target(env, method, @url || "")
        set_host(env, http10)
        request = Request.new(env, method == "HEAD", http10, @limits.max_body_in_memory)
        if !http10 && (env["HTTP_TRANSFER_ENCODING"] || content_length.to_i.positive?)
          request.expects_continue = env["HTTP_EXPECT"]&.casecmp?("100-continue") || false
        end
        request
      end

      def set_target(env, method, url)
        if url.start_with?("/") && !url.include?("?") && !url.include?("#")
          path = url # the common target, a bare path: nothing to split
        elsif url.start_with?("/")
          path, query = url.split("?", 2)
          query = query&.split("#", 2)&.first
          path = path.split("#", 2).first || "/"
        elsif url == "*" && method == "OPTIONS"
          path = "*"
        elsif method == "CONNECT"
          path = url
        elsif (match = %r{\Ahttps?://[^/?#]*(/[^?#]*)?(?:\?([^#]*))?}i.match(url))
          path = match[1] || "/"
          query = match[2]
        else
          fail_with(400, "request target #{url[0, 100].inspect}")
        end
        env["PATH_INFO"] = path
        env["QUERY_STRING"] = query || ""
      end

      def ipv6?(text)
        IPAddr.new(text).ipv6?
      rescue IPAddr::Error
        false
      end

      # The common Host (`example.com`, `10.0.0.1:8080`: letters, digits, `.`
      # and `-`, then maybe `:` and digits), checked without a regex; a
      # subset of {HOST}, which checks the rest.
      def plain_host?(host)
        colon = host.index(":")
        return !host.empty? && host.count("A-Za-z0-9.\\-") == host.bytesize unless colon

        port_bytes = host.bytesize - colon - 1
        colon.positive? && host.count("A-Za-z0-9.\\-") == host.bytesize - 1 &&
          host.byteslice(colon + 1, port_bytes).count("0-9") == port_bytes
      end

      # SERVER_NAME and SERVER_PORT from Host. A connection's requests nearly
      # always repeat their Host, so the last one's check and split are kept
      # (frozen, shared by those requests' envs).
      def set_host(env, http10)
        host = env["HTTP_HOST"]
        if host && host == @host
          env["SERVER_NAME"] = @server_name
          env["SERVER_PORT"] = @server_port
          return
        end
        unless host
          fail_with(400, "HTTP/1.1 request without Host") unless http10
          env["SERVER_NAME"] = @default_host
          env["SERVER_PORT"] = @default_port
          return
        end
        unless plain_host?(host) || (host.match?(HOST) && (!host.start_with?("[") || ipv6?(host[1...host.index("]")])))
          fail_with(400, "invalid Host #{host[0, 100].inspect}")
        end

        name, port = host.start_with?("[") ? host.split(/(?<=\])(?::)/, 2) : host.split(":", 2)
        @host = -host
        env["SERVER_NAME"] = @server_name = -name
        env["SERVER_PORT"] = @server_port = port.nil? || port.empty? ? "80" : -port
      end
    end
  end
end
