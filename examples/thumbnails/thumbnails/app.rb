# frozen_string_literal: true

require "json"

module Thumbnails
  # The Rack app: `GET /thumb/<width>x<height>/<key>` answers a thumbnail of
  # the origin's `<key>` that fits within width x height, in the format of
  # the key's extension (.jpg/.jpeg, .png or .webp); `GET /stats` answers
  # this process's counters as JSON.
  #
  # A request for a thumbnail:
  # 1. is checked: sizes 1..`max_size`, a key of URL-safe characters with a
  #    known extension, else 400;
  # 2. is answered from the {LruCache} when the thumbnail is there;
  # 3. otherwise joins the {Coalescer}: the first request for a thumbnail
  #    fetches the original ({Origin}) and resizes it ({Resizer}), requests
  #    for the same thumbnail meanwhile wait for that one result, and the
  #    result goes into the cache.
  #
  # Responses carry an ETag (a digest of the thumbnail's bytes; a matching
  # If-None-Match gets 304), `Cache-Control: public, max-age=<max_age>`,
  # and `x-cache: hit` (from memory), `miss` (made for this request) or
  # `coalesced` (made for a request in flight at the same time). Errors:
  # 404 (the origin has no such key), 502 (the origin failed, or its object
  # is not an image), 503 (too many fetches or resizes waiting), 504 (the
  # origin did not answer within its timeout).
  class App
    # The route: sizes, then the key (letters, digits, `._-/`, and an extension).
    ROUTE = %r{\A/thumb/([^/]+)/(.+)\z}
    SIZE = /\A([1-9]\d{0,5})x([1-9]\d{0,5})\z/
    KEY = %r{\A[A-Za-z0-9_\-][A-Za-z0-9._\-/]*\.([A-Za-z0-9]+)\z}

    # @return [Origin]
    attr_reader :origin

    # @return [Resizer]
    attr_reader :resizer

    # @return [LruCache]
    attr_reader :cache

    # @param origin [Origin]
    # @param resizer [Resizer]
    # @param cache_bytes [Integer] memory for thumbnails, in bytes.
    # @param max_size [Integer] the largest width or height accepted.
    # @param max_age [Integer] seconds clients and CDNs may keep a thumbnail.
    def initialize(origin:, resizer:, cache_bytes: 64 * 1024 * 1024, max_size: 2000, max_age: 86_400)
      @origin = origin
      @resizer = resizer
      @cache = LruCache.new(max_bytes: cache_bytes)
      @coalescer = Coalescer.new
      @max_size = max_size
      @cache_control = "public, max-age=#{max_age}"
      @answers = Hash.new(0) # x-cache value => count
    end

    # @param env [Hash] the Rack env.
    # @return [Array] the Rack response.
    def call(env)
      return error(405, "only GET and HEAD", "allow" => "GET, HEAD") unless %w[GET HEAD].include?(env["REQUEST_METHOD"])
      return stats_response if env["PATH_INFO"] == "/stats"

      route = ROUTE.match(env["PATH_INFO"]) or return error(404, "no such route: GET /thumb/<width>x<height>/<key>")
      size = SIZE.match(route[1]) or return error(400, "the size must be <width>x<height>, like 200x150")
      width = Integer(size[1])
      height = Integer(size[2])
      return error(400, "width and height must be at most #{@max_size}") if [width, height].max > @max_size

      key = route[2]
      format = KEY.match(key)&.[](1)&.downcase
      return error(400, "bad key #{key.inspect}: letters, digits, ._-/ and an extension") if format.nil? || key.include?("..")
      return error(400, "unsupported format .#{format}: use #{Resizer::FORMATS.keys.map { |f| ".#{f}" }.join(', ')}") unless
        Resizer::FORMATS.key?(format)

      thumbnail, answer = thumbnail(key, width, height, format)
      @answers[answer] += 1
      respond(env, thumbnail, answer)
    rescue Origin::NotFound => e
      error(404, e.message)
    rescue NeverBlock::TimeoutError
      error(504, "the origin did not answer in time")
    rescue NeverBlock::PoolFull, NeverBlock::PoolTimeout
      error(503, "too busy: try again shortly", "retry-after" => "1")
    rescue Origin::Error, Resizer::NotAnImage, SystemCallError, IOError, Net::HTTPBadResponse => e
      error(502, "bad gateway: #{e.message}")
    end

    # @return [Hash] requests answered by each x-cache value, fetches, resizes, cache and pools.
    def stats
      { answers: @answers.dup, origin_fetches: @origin.fetches, resizes: @resizer.resizes,
        in_flight: @coalescer.in_flight, cache: { entries: @cache.size, bytes: @cache.bytes, max_bytes: @cache.max_bytes },
        origin_pool: @origin.stats, resize_pool: @resizer.stats }
    end

    # Closes the origin connections.
    # @return [void]
    def close
      @origin.close
    end

    private

    # @return [Array(Thumbnail, String)] the thumbnail and its x-cache value.
    def thumbnail(key, width, height, format)
      cache_key = "#{width}x#{height}/#{key}"
      if (cached = @cache[cache_key])
        return [cached, "hit"]
      end

      made, shared = @coalescer.call(cache_key) do
        resized = @resizer.resize(@origin.get(key), width, height, format)
        @cache.store(cache_key, resized, resized.body.bytesize)
        resized
      end
      [made, shared ? "coalesced" : "miss"]
    end

    def respond(env, thumbnail, answer)
      headers = { "etag" => thumbnail.etag, "cache-control" => @cache_control, "x-cache" => answer }
      return [304, headers, []] if etag_matches?(env["HTTP_IF_NONE_MATCH"], thumbnail.etag)

      headers["content-type"] = thumbnail.content_type
      headers["content-length"] = thumbnail.body.bytesize.to_s
      [200, headers, env["REQUEST_METHOD"] == "HEAD" ? [] : [thumbnail.body]]
    end

    # If-None-Match: `*`, or a list of (possibly weak) ETags.
    def etag_matches?(header, etag)
      return false unless header

      header.strip == "*" || header.split(",").any? { |tag| tag.strip.delete_prefix("W/") == etag }
    end

    def stats_response
      [200, { "content-type" => "application/json" }, [JSON.generate(stats)]]
    end

    def error(status, message, headers = {})
      [status, { "content-type" => "text/plain; charset=utf-8", "cache-control" => "no-store" }.merge(headers),
       ["#{message}\n"]]
    end
  end
end
