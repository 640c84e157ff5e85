# frozen_string_literal: true

module NeverBlock
  class Debouncer
    # Decides, from an upstream response's status and headers, whether
    # followers may share it and for how many seconds it may answer later
    # identical requests.
    module CachePolicy
      # Statuses whose responses may be stored (RFC 9110's heuristically
      # cacheable ones, without 206 and 5xx). Any other response may still be
      # shared with the requests that waited for it, but is not stored.
      STORABLE = [200, 203, 204, 300, 301, 308, 404, 405, 410, 414].freeze

      module_function

      # @param status [Integer]
      # @param headers [Hash] the app's response headers.
      # @param ttl [Numeric] the debouncer's ttl, seconds.
      # @return [Symbol, Numeric] `:private` when only the leader may see the
      #   response (Set-Cookie, `Cache-Control: private`, `Vary: *`); else
      #   the seconds it may be stored (0: share with waiting followers only).
      def decide(status, headers, ttl)
        return :private if header(headers, "set-cookie")

        directives = cache_control(headers)
        return :private if directives.key?("private")
        return :private if vary(headers).include?("*")
        return 0 if ttl <= 0 || !STORABLE.include?(status)
        return 0 if directives.key?("no-store") || directives.key?("no-cache")

        max_age = directives["s-maxage"] || directives["max-age"]
        max_age ? [ttl, max_age].min : ttl
      end

      # @param headers [Hash]
      # @return [Array<String>] the header names a response's Vary lists.
      def vary(headers)
        (header(headers, "vary") || "").split(",").map(&:strip).reject(&:empty?)
      end

      # @param headers [Hash]
      # @return [Hash{String => Integer, true}] Cache-Control directives;
      #   `max-age` and `s-maxage` as Integers (0 when unparsable).
      def cache_control(headers)
        (header(headers, "cache-control") || "").split(",").to_h do |directive|
          name, value = directive.strip.split("=", 2)
          name = name.to_s.downcase
          [name, %w[max-age s-maxage].include?(name) ? Integer(value.to_s.delete('"'), exception: false).to_i : true]
        end
      end

      # @param headers [Hash]
      # @param name [String] lowercase.
      # @return [String, nil] the header's value, case-insensitively (Rack 2
      #   apps use mixed case), Array values joined.
      def header(headers, name)
        value = headers.fetch(name) { headers.find { |key, _| key.casecmp?(name) }&.last }
        value.is_a?(Array) ? value.join(", ") : value
      end
    end
  end
end
