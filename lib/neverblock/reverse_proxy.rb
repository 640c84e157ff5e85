# frozen_string_literal: true

require "socket"
require "io/wait"
require "uri"
require "neverblock"
require "neverblock/connection_pool"
require_relative "reverse_proxy/upstream_connection"

module NeverBlock
  # A Rack app that forwards every request to one upstream HTTP/1.1 origin
  # over persistent (keep-alive) connections, pooled and shared by the
  # fibers and threads of the process, and streams the response back.
  #
  #   run NeverBlock::ReverseProxy.new("http://127.0.0.1:8080", pool_size: 64)
  #
  # - The request goes upstream as it came: method, path and query, headers
  #   (minus hop-by-hop ones: Connection and what it names, Keep-Alive,
  #   Proxy-*, TE, Trailer, Transfer-Encoding, Upgrade), body; Host is the
  #   upstream's unless `preserve_host:`; X-Forwarded-For, -Host and -Proto
  #   are set to this hop's view: a client's own (and its `Forwarded`) are
  #   dropped, unless `trust_forwarded: true` (behind a front proxy), which
  #   passes them on with this hop appended.
  # - The response comes back with its status and every end-to-end header
  #   (repeated ones, like Set-Cookie, as an Array); its body streams (the
  #   connection goes back to the pool when the body has been read, or is
  #   closed when the body is closed early).
  # - Upstream failures: a refused, reset or closed connection answers 502,
  #   a timeout (`connect_timeout`, or `timeout` for each read and write) 504,
  #   each with a short plain-text body and `X-Upstream-Error`; an idempotent
  #   request whose reused connection turns out to be closed by the upstream
  #   is sent once more on a new one.
  #
  # Inside NeverBlock, waiting for the upstream suspends only the fiber; in
  # plain threads it blocks the thread.
  class ReverseProxy
    # Request headers that end at this hop (RFC 9110 7.6.1), as Rack env keys.
    HOP_BY_HOP = %w[HTTP_CONNECTION HTTP_KEEP_ALIVE HTTP_PROXY_CONNECTION HTTP_PROXY_AUTHORIZATION
                    HTTP_TE HTTP_TRAILER HTTP_TRANSFER_ENCODING HTTP_UPGRADE HTTP_HOST
                    HTTP_VERSION HTTP_EXPECT].freeze

    NONE_NAMED = {}.freeze
    private_constant :NONE_NAMED

    # Response headers that end at this hop (lowercase).
    RESPONSE_HOP_BY_HOP = %w[connection keep-alive proxy-connection proxy-authenticate te trailer
                             transfer-encoding upgrade].freeze

    # Methods sent again on a fresh connection when a reused one was closed
    # by the upstream before it answered.
    IDEMPOTENT = %w[GET HEAD OPTIONS PUT DELETE TRACE].freeze

    # @return [URI::HTTP] the upstream origin.
    attr_reader :upstream

    # @param upstream [String, URI] `http://HOST:PORT` (a path prefix is
    #   prepended to every request path).
    # @param pool_size [Integer] most connections kept open to the upstream.
    # @param connect_timeout [Numeric] seconds to connect.
    # @param timeout [Numeric] seconds any one read or write may wait.
    # @param pool_timeout [Numeric] seconds a request may wait for a pooled connection.
    # @param preserve_host [Boolean] send the client's Host instead of the upstream's.
    # @param trust_forwarded [Boolean] false (the default): a client's
    #   Forwarded and X-Forwarded-* headers are replaced by this hop's
    #   (X-Forwarded-For: the client's address; -Host: its Host; -Proto: the
    #   scheme it used); true (behind a front proxy that sets them): they are
    #   passed on with this hop appended.
    # @raise [ArgumentError] for a URL that is not http://HOST[:PORT][/PREFIX].
    def initialize(upstream, pool_size: 64, connect_timeout: 5, timeout: 30, pool_timeout: 10, preserve_host: false,
                   trust_forwarded: false)
      @upstream = URI(upstream.to_s)
      unless @upstream.is_a?(URI::HTTP) && !@upstream.is_a?(URI::HTTPS) && @upstream.host && !@upstream.host.empty?
        raise ArgumentError, "upstream must be http://HOST[:PORT][/PREFIX], got #{upstream.to_s.inspect}"
      end

      @host = @upstream.host.delete_prefix("[").delete_suffix("]")
      @port = @upstream.port
      @prefix = @upstream.path.to_s.chomp("/")
      @host_header = @upstream.port == @upstream.default_port ? @upstream.host : "#{@upstream.host}:#{@port}"
      @connect_timeout = NeverBlock.validate_timeout!(connect_timeout, :connect_timeout)
      @timeout = NeverBlock.validate_timeout!(timeout, :timeout)
      @preserve_host = preserve_host
      @trust_forwarded = trust_forwarded ? true : false
      @pool = ConnectionPool.new(size: pool_size, timeout: pool_timeout, name: "upstream #{@host_header}",
                                 healthy: ->(connection) { connection.healthy? }) do
        UpstreamConnection.open(@host, @port, @connect_timeout, @timeout)
      end
    end

    # Forwards one request.
    # @param env [Hash] the Rack env.
    # @return [Array] `[status, headers, body]`; the body streams from the upstream.
    def call(env)
      head = request_head(env)
      body = request_body(env)
      method = env["REQUEST_METHOD"]
      attempt(method, head, body, retry_allowed: IDEMPOTENT.include?(method) && (body.nil? || body[1]&.zero?))
    rescue UpstreamConnection::Timeout => e
      failure(504, "upstream timed out: #{e.message}")
    rescue PoolTimeout
      failure(503, "all #{@pool.size} upstream connections are busy")
    rescue SystemCallError, IOError, UpstreamConnection::Closed, UpstreamConnection::BadResponse => e
      failure(502, "upstream failed: #{e.class}: #{e.message}")
    end

    # @return [Hash] the upstream connection pool's {ConnectionPool#stats}.
    def stats
      @pool.stats
    end

    # Closes the idle upstream connections (busy ones when they come back).
    # @return [void]
    def close
      @pool.disconnect_all
    end

    private

    # The connection is held by a token of this request (not by the
    # fiber): the body may be read and closed elsewhere.
    def attempt(method, head, body, retry_allowed:)
      owner = Object.new
      connection = @pool.checkout(owner: owner)
      reused = connection.used?
      begin
        status, headers = connection.exchange(head, body, head: method == "HEAD")
      rescue UpstreamConnection::Closed, Errno::ECONNRESET, Errno::EPIPE
        @pool.discard(connection, owner: owner)
        raise unless reused && retry_allowed

        return attempt(method, head, body, retry_allowed: false)
      rescue Exception # rubocop:disable Lint/RescueException -- a connection in an unknown state is not reused
        @pool.discard(connection, owner: owner)
        raise
      end
      [status, response_headers(headers), ResponseBody.new(connection, @pool, owner)]
    end

    def request_head(env)
      path = "#{@prefix}#{env['SCRIPT_NAME']}#{env['PATH_INFO']}"
      path = "/#{path}" unless path.start_with?("/")
      query = env["QUERY_STRING"]
      target = query.nil? || query.empty? ? path : "#{path}?#{query}"
      lines = +"#{env['REQUEST_METHOD']} #{target} HTTP/1.1\r\n"
      client_host = env["HTTP_HOST"] || env["SERVER_NAME"]
      lines << "host: #{@preserve_host && client_host ? client_host : @host_header}\r\n"
      drop = named_in(env["HTTP_CONNECTION"], dashes: true)
      env.each do |key, value|
        next unless key.start_with?("HTTP_") && !HOP_BY_HOP.include?(key)
        next if key.start_with?("HTTP_X_FORWARDED_") || key == "HTTP_FORWARDED"

        name = header_name(key)
        lines << name << ": " << value.to_s << "\r\n" unless drop.key?(name)
      end
      lines << "content-type: #{env['CONTENT_TYPE']}\r\n" if env["CONTENT_TYPE"] && !env["CONTENT_TYPE"].empty?
      forwarded_headers(env, client_host, lines)
      lines
    end

    # Untrusted (the default), what the client says about earlier hops is
    # dropped: the upstream learns this hop's view only. Trusted (behind a
    # front proxy that sets them), they go on with this hop appended.
    def forwarded_headers(env, client_host, lines)
      trusted = @trust_forwarded
      forwarded_for = [(env["HTTP_X_FORWARDED_FOR"] if trusted), env["REMOTE_ADDR"]].compact.reject(&:empty?).join(", ")
      lines << "x-forwarded-for: #{forwarded_for}\r\n" unless forwarded_for.empty?
      host = (env["HTTP_X_FORWARDED_HOST"] if trusted) || client_host
      lines << "x-forwarded-host: #{host}\r\n" if host
      proto = (env["HTTP_X_FORWARDED_PROTO"] if trusted) || env["rack.url_scheme"] || "http"
      lines << "x-forwarded-proto: #{proto}\r\n"
      forwarded(env, host, proto, lines) if trusted && env["HTTP_FORWARDED"]
    end

    # A client's `Forwarded` (RFC 7239) goes on with this hop's element
    # appended, as X-Forwarded-For does: Rack reads Forwarded before the
    # X-Forwarded-* headers, so passed on alone it would let any client
    # name the address (`for=`), host and scheme the upstream believes.
    def forwarded(env, host, proto, lines)
      node = env["REMOTE_ADDR"].to_s
      node = "\"[#{node}]\"" if node.include?(":")
      element = +"for=#{node.empty? ? 'unknown' : node}"
      element << ";host=\"#{host.delete('"\\')}\"" if host
      element << ";proto=#{proto}" if proto.match?(/\A[A-Za-z][A-Za-z0-9+.-]*\z/)
      lines << "forwarded: #{env['HTTP_FORWARDED']}, #{element}\r\n"
    end

    # The headers a Connection value names, which are hop-by-hop too.
    # @return [Hash{String => true}] the names, lowercase; with `dashes`,
    #   `_` read as `-` (a request's, as #header_name makes names from env
    #   keys, where Rack has `_` for both). One String a name, looked up once
    #   a header: a client's Connection of thousands of names costs
    #   milliseconds, where a list searched per header cost tens.
    def named_in(value, dashes: false)
      return NONE_NAMED if value.nil? || value.empty?

      value.downcase.split(",").each_with_object({}) do |name, named|
        name.strip!
        name.tr!("_", "-") if dashes
        named[name] = true
      end
    end

    def header_name(key)
      key.delete_prefix("HTTP_").downcase.tr("_", "-")
    end

    # @return [Array(String, Integer), Array(IO, nil), nil] what to send as
    #   the body: a length and the input, or the input to send chunked.
    def request_body(env)
      input = env["rack.input"]
      length = env["CONTENT_LENGTH"]
      if length && !length.empty?
        [input, Integer(length, 10)]
      elsif input && !%w[GET HEAD DELETE OPTIONS TRACE].include?(env["REQUEST_METHOD"])
        [input, nil]
      end
    end

    def response_headers(headers)
      result = {}
      drop = named_in(Array(headers["connection"]).join(",")) # (an Array: Connection twice)
      headers.each do |name, value|
        next if RESPONSE_HOP_BY_HOP.include?(name) || drop.key?(name)

        result[name] = value
      end
      result
    end

    def failure(status, message)
      NeverBlock.logger.warn("NeverBlock::ReverseProxy") { "#{@host_header}: #{message}" }
      reason = status == 504 ? "timeout" : "unavailable"
      body = "#{status} upstream #{reason}\n"
      [status, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s,
                 "x-upstream-error" => reason }, [body]]
    end

    # The upstream response's body, read from the connection as the server
    # writes it out. The connection goes back to the pool once the body has
    # been read to its end and the upstream keeps the connection alive;
    # closing it earlier closes the connection.
    class ResponseBody
      # @api private
      def initialize(connection, pool, owner)
        @connection = connection
        @pool = pool
        @owner = owner
      end

      # @yieldparam chunk [String]
      # @return [void]
      def each(&block)
        raise IOError, "the upstream response body is closed" unless @connection

        @connection.each_body_chunk(&block)
      end

      # Gives the connection back (or closes it if the body was not read
      # to its end). Idempotent.
      # @return [void]
      def close
        connection = @connection or return
        @connection = nil
        if connection.reusable?
          @pool.checkin(connection, owner: @owner)
        else
          @pool.discard(connection, owner: @owner)
        end
      end
    end
  end
end
