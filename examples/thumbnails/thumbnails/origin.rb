# frozen_string_literal: true

require "net/http"
require "uri"

module Thumbnails
  # The S3-style origin: `GET <origin_url>/<key>` answers the original image.
  #
  # Plain Net::HTTP. Inside NeverBlock a fetch suspends only its fiber while
  # it waits for the origin, so one process has many fetches in flight.
  # They go over keep-alive connections in a NeverBlock::ConnectionPool of
  # `concurrency` Net::HTTP sessions, which is also the limit on fetches at
  # once: a fetch beyond it waits (FIFO) for a connection, at most
  # `queue_timeout` seconds (then NeverBlock::PoolTimeout).
  #
  # Each fetch, connecting included, has `timeout` seconds
  # (NeverBlock.timeout, raising NeverBlock::TimeoutError); the connection
  # it used is then closed, since it is in the middle of a response.
  class Origin
    # Something went wrong at the origin (the app answers 502).
    class Error < StandardError; end

    # The origin has no such key (the app answers 404).
    class NotFound < Error; end

    # The original is larger than `max_bytes` (its download was stopped).
    class TooLarge < Error; end

    # @return [Integer] fetches started since the start (each is one GET at the origin).
    attr_reader :fetches

    # @param url [String] `http(s)://host[:port][/prefix]`; a key is fetched from `url/key`.
    # @param concurrency [Integer] connections, so fetches at once (>= 1).
    # @param timeout [Numeric] seconds a fetch may take, connecting included.
    # @param queue_timeout [Numeric] seconds a fetch may wait for a connection.
    # @param max_bytes [Integer] the largest original accepted.
    # @raise [ArgumentError] for a URL that is not http(s).
    def initialize(url, concurrency: 16, timeout: 5, queue_timeout: 10, max_bytes: 25 * 1024 * 1024)
      @base = URI(url)
      raise ArgumentError, "the origin URL must be http(s)://host[/prefix], got #{url.inspect}" unless
        @base.is_a?(URI::HTTP) && @base.host

      @prefix = @base.path.chomp("/")
      @timeout = NeverBlock.validate_timeout!(timeout, :timeout)
      @max_bytes = max_bytes
      @fetches = 0
      @pool = NeverBlock::ConnectionPool.new(
        size: concurrency, timeout: queue_timeout, name: "thumbnails origin #{@base.host}",
        broken_on: NeverBlock::ConnectionPool::BROKEN_ON + [TooLarge, Net::HTTPBadResponse],
        close: ->(http) { http.finish if http.started? }
      ) { Net::HTTP.new(@base.host, @base.port).tap { |http| http.use_ssl = @base.scheme == "https" } }
    end

    # @param key [String] an object key, already checked (no `..`, URL-safe characters).
    # @return [String] the original's bytes (binary).
    # @raise [NotFound] when the origin answers 404.
    # @raise [Error] for any other answer than 200, or an original over `max_bytes`.
    # @raise [NeverBlock::TimeoutError] after `timeout` seconds.
    # @raise [NeverBlock::PoolTimeout] when no connection was free within `queue_timeout`.
    # @raise [SystemCallError, IOError] when the origin cannot be reached.
    def get(key)
      @pool.with do |http|
        @fetches += 1
        NeverBlock.timeout(@timeout) { download(http, "#{@prefix}/#{key}") }
      end
    end

    # Closes the idle connections (busy ones as they come back).
    # @return [void]
    def close
      @pool.disconnect_all
    end

    # @return [Hash] the connection pool's `{size:, in_use:, idle:, waiting:}`.
    def stats
      @pool.stats
    end

    private

    def download(http, path)
      http.start unless http.started? # a new connection, or one a failure closed
      body = String.new(encoding: Encoding::BINARY)
      response = http.request(Net::HTTP::Get.new(path)) do |answer|
        # Anything but a 200 is read to its end by Net::HTTP after this block
        # (an error page is small), so the connection stays usable.
        next unless answer.is_a?(Net::HTTPOK)

        answer.read_body do |chunk|
          body << chunk
          raise TooLarge, "the original #{path} is over #{@max_bytes} bytes" if body.bytesize > @max_bytes
        end
      end
      return body if response.is_a?(Net::HTTPOK)
      raise NotFound, "the origin has no #{path}" if response.is_a?(Net::HTTPNotFound)

      raise Error, "the origin answered #{response.code} for #{path}"
    end
  end
end
