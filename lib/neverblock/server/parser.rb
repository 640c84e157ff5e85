# frozen_string_literal: true

require "ipaddr"

require_relative "../llhttp_pin"
begin
  require "neverblock/http_head"
rescue LoadError
  nil # not compiled (a `path:` gem): every head goes through llhttp's callbacks (see Parser.head_parser?)
end
require_relative "parser/empty_lines"
require_relative "parser/head_form"
require_relative "parser/head_feeding"

module NeverBlock
  class Server
    # Turns the bytes of one connection into {Request}s: llhttp (in its
    # strict mode, which rejects the request-smuggling shapes: Content-Length
    # with Transfer-Encoding, duplicate or invalid Content-Length, bare CR/LF
    # in headers, NUL or CTL in the target) parses the heads, and the Parser
    # enforces the {Limits} llhttp has no notion of ({HeadFeeding} gives
    # llhttp a head's bytes, whole, once its empty line came; {HeadForm}
    # checks them first). Up to {EmptyLines::MAX_EMPTY_LINES} empty lines
    # before a request line are skipped ({EmptyLines}). A request gets
    # the same verdict however its bytes are split into reads.
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

      include EmptyLines
      include HeadForm
      include HeadFeeding

      # Not a single regex match runs per ordinary request: a match, here
      # inside llhttp's callbacks, takes Onigmo's ~6 KiB alloca stack and
      # deepens every connection fiber's stack by a page, which each idle
      # keep-alive connection then keeps (40 MB per 10,000 connections).

      # RFC 3986 host (a reg-name, `%` only as a `%XX` escape; or an IPv6
      # literal, checked further by {#ipv6?}) with an optional port, as
      # Rack::Lint wants HTTP_HOST.
      HOST = /\A(?:\[[0-9A-Fa-f:.]+\]|(?:%\h\h|[A-Za-z0-9\-._~!$&'()*+,;=])+)(?::\d*)?\z/

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
        @held = nil          # the bytes of a head that spans reads, until it ends (HeadFeeding)
        @line_end = nil      # where that head's request line ends (HeadForm)
        @line_searched = 0
        @ends_checked = 0
        @empty_lines = 0     # empty lines read before the next request line (EmptyLines)
        @empty_cr = false    # the last of them has its CR, not its LF yet
        @host = nil # the last Host seen on this connection, already checked
        @server_name = nil
        @server_port = nil
        @timed = !limits.request_timeout.nil? # requests need their head's time
        @llhttp = nil # made for the first head the C fast path declines (#feed_head): most connections need none
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
                   elsif @in_message
                     take_head(data, offset)
                   elsif head && !@empty_cr && (env = head.parse(data, offset))
                     # (HTTPHead declines bytes that begin with a CR or LF:
                     # an empty line goes on to #take_empty_lines, and the
                     # common head costs no #empty_line? first)
                     plain_request(env, data, head.head_end)
                   elsif empty_line?(data, offset)
                     take_empty_lines(data, offset)
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

      # @return [Request, nil] the request whose body is being read, while
      #   {#in_body?}.
      def body_request
        @current unless @current&.complete
      end

      # --- llhttp callbacks at a head's end (the others: HeadFeeding) ---------

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
        request.keep_alive = head.keep_alive?
        @requests << request
        @empty_lines = 0
        length = head.content_length
        if length.zero?
          request.complete = true
          @closed = true unless request.keep_alive # nothing read after it (#finish_request)
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

      def build_request
        llhttp = @llhttp
        fail_with(505, "HTTP/#{llhttp.http_major}.#{llhttp.http_minor}") unless llhttp.http_major == 1
        http10 = llhttp.http_minor.zero?
        method = -llhttp.method_name # frozen and interned, as the C path's
        content_length = @headers["CONTENT_LENGTH"]
        if (coding = @headers["HTTP_TRANSFER_ENCODING"])
          # llhttp ignores an empty Transfer-Encoding (and so its check against
          # Content-Length); RFC 9112 6.1: HTTP/1.0 framing with it is faulty.
          fail_with(400, "empty Transfer-Encoding") if coding.strip.empty?
          fail_with(400, "Transfer-Encoding in an HTTP/1.0 request") if llhttp.http_minor.zero?
          check_transfer_coding(coding)
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

      # The Parser decodes one transfer coding, chunked, applied once
      # (RFC 9112 6.1, 7): a list that does not end in chunked, or names it
      # twice, leaves the body's length unknown (400); any other coding
      # before it (`gzip, chunked`; `identity`, which no registry lists any
      # more) is one the server does not decode, and the app would be given
      # a body in a coding nothing tells it of (501 Not Implemented, as
      # Puma and nginx answer). Empty list elements are ignored (RFC 9110
      # 5.6.1). llhttp refuses the first case too, after this callback.
      def check_transfer_coding(value)
        codings = value.split(",").map(&:strip).reject(&:empty?)
        unless codings.last&.casecmp?("chunked")
          fail_with(400, "Transfer-Encoding #{value[0, 100].inspect} does not end in chunked")
        end
        return if codings.size == 1

        if codings.count { |coding| coding.casecmp?("chunked") } > 1
          fail_with(400, "Transfer-Encoding #{value[0, 100].inspect} applies chunked twice")
        end
        fail_with(501, "Transfer-Encoding #{value[0, 100].inspect}: only chunked is decoded")
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
