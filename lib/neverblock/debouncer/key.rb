# frozen_string_literal: true

require "digest/sha2"

module NeverBlock
  class Debouncer
    # Computes a request's coalescing key: two requests with the same key are
    # the same request, and may share one upstream response.
    #
    # The key covers the method, scheme, host, path, the query with its
    # parameters sorted (by name; values of one name keep their order, since
    # `a[]=1&a[]=2` differs from `a[]=2&a[]=1`), and the values of the
    # configured `vary` request headers, of the forwarding headers
    # ({FORWARDING}: an upstream builds links and redirects from those, so a
    # request that sets them, as `X-Forwarded-Host: evil.example` from any
    # client, must neither get nor store the response for one that does not)
    # and of the headers that make a request conditional or partial
    # ({CONDITIONAL}: a 304 or a 206 answers only the requests that asked for
    # it). A request carrying `Authorization` or `Cookie` has no key (it is
    # not coalesced) unless credentials are shared per credential; then a
    # SHA-256 of each credential is part of the key.
    #
    # Keys are SHA-256 hex digests: a store never holds a raw URL or a raw
    # credential, and every key has the same small size.
    class Key
      # The request headers (Rack env names) that carry credentials.
      CREDENTIALS = %w[HTTP_AUTHORIZATION HTTP_COOKIE].freeze

      # The request headers (Rack env names) that tell the app which scheme,
      # host, port and path prefix the client used (Rack::Request and Rails
      # read them).
      FORWARDING = %w[HTTP_FORWARDED HTTP_X_FORWARDED_HOST HTTP_X_FORWARDED_PROTO HTTP_X_FORWARDED_SCHEME
                      HTTP_X_FORWARDED_SSL HTTP_X_FORWARDED_PORT HTTP_X_FORWARDED_PREFIX].freeze

      # The request headers (Rack env names) that make a request conditional
      # (304, 412) or partial (206).
      CONDITIONAL = %w[HTTP_IF_NONE_MATCH HTTP_IF_MODIFIED_SINCE HTTP_IF_MATCH HTTP_IF_UNMODIFIED_SINCE
                       HTTP_RANGE HTTP_IF_RANGE].freeze

      # Request headers in every key when present.
      KEYED = (FORWARDING + CONDITIONAL).freeze
      private_constant :KEYED

      # @param vary [Array<String>] request header names always part of the key.
      # @param share_credentials [false, :per_credential] see {Debouncer#initialize}.
      def initialize(vary: [], share_credentials: false)
        @vary = vary.map { |name| Key.env_name(name) }.sort.freeze
        @share_credentials = share_credentials
      end

      # @param env [Hash] a Rack env.
      # @return [String, nil] the key, or nil when the request must not be
      #   coalesced (it carries credentials that are not shared).
      def call(env)
        credentials = CREDENTIALS.filter_map { |name| "#{name}=#{Key.credential_digest(env[name])}" if env[name] }
        return nil if !credentials.empty? && @share_credentials != :per_credential

        Key.digest([
          env["REQUEST_METHOD"], env["rack.url_scheme"], host(env),
          "#{env['SCRIPT_NAME']}#{env['PATH_INFO']}", Key.sorted_query(env["QUERY_STRING"]),
          *@vary.map { |name| "#{name}=#{env[name]}" },
          *KEYED.filter_map { |name| "#{name}=#{env[name]}" if env[name] }, *credentials
        ])
      end

      # The key of a request whose response varies on `names` (from the
      # response's Vary header): the base key plus this request's values.
      #
      # @param base [String] the key from {#call}.
      # @param names [Array<String>] header names, as the response named them.
      # @param env [Hash]
      # @return [String]
      def varied(base, names, env)
        Key.digest([base, *Key.values(names, env).map { |name, value| "#{name}=#{value}" }])
      end

      # @param names [Array<String>] request header names (`Accept-Language`).
      # @param env [Hash]
      # @return [Hash{String => String, nil}] the request's value of each,
      #   keyed by lowercased header name.
      def self.values(names, env)
        names.to_h { |name| [name.downcase, env[env_name(name)]] }
      end

      # @param name [String] an HTTP header name.
      # @return [String] its Rack env key (`Accept-Language` -> `HTTP_ACCEPT_LANGUAGE`).
      def self.env_name(name)
        upper = name.to_s.upcase.tr("-", "_")
        %w[CONTENT_TYPE CONTENT_LENGTH].include?(upper) ? upper : "HTTP_#{upper}"
      end

      # @param query [String, nil]
      # @return [String] the parameters sorted by name, stable for equal names.
      def self.sorted_query(query)
        return "" if query.nil? || query.empty?

        query.split(/[&;]/).reject(&:empty?).each_with_index
             .sort_by { |pair, index| [pair.split("=", 2).first, index] }.map(&:first).join("&")
      end

      # @param value [String]
      # @return [String] a SHA-256 hex digest of a credential.
      def self.credential_digest(value)
        Digest::SHA256.hexdigest("neverblock-debouncer-credential\0#{value}")
      end

      # @param parts [Array<String, nil>]
      # @return [String] a SHA-256 hex digest of the parts, length-prefixed so
      #   that no two different part lists give the same input.
      def self.digest(parts)
        Digest::SHA256.hexdigest(parts.map { |part| "#{part.to_s.bytesize}:#{part}" }.join)
      end

      private

      def host(env)
        (env["HTTP_HOST"] || "#{env['SERVER_NAME']}:#{env['SERVER_PORT']}").downcase
      end
    end
  end
end
