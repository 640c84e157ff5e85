# frozen_string_literal: true

module NeverBlock
  class Server
    # The limits a request must stay within, and how long the server waits
    # for a client. Sizes are bytes, timeouts seconds.
    #
    # - `max_request_target` :: bytes of the request target (the URL), else 414 (default 8 KiB)
    # - `max_header_bytes`   :: bytes of the header block, else 431 (default 64 KiB)
    # - `max_headers`        :: header lines, else 431 (default 100)
    # - `max_body`           :: bytes of a request body, else 413 (default 10 MiB)
    # - `max_body_in_memory` :: bytes of a request body kept in a String; a larger body
    #                           is written to an unlinked Tempfile, closed after its
    #                           response, which becomes `rack.input` (default 64 KiB)
    # - `max_connections`    :: open client connections; at this many the server stops
    #                           accepting and new ones wait in the kernel's backlog
    #                           (default 16,384, or fewer when the open-file limit,
    #                           `ulimit -n`, is lower: that limit minus 128 descriptors
    #                           left for the app's files and database connections)
    # - `header_timeout`     :: seconds from a request's first byte to the end of its
    #                           headers, else 408 (default 10)
    # - `body_timeout`       :: seconds the body may make no progress, else 408 (default 10)
    # - `min_body_rate`      :: bytes per second a request body must average over each
    #                           `body_timeout` seconds from the end of its head, else 408
    #                           (default 1024; 0: no minimum). See {BodyPace}
    # - `idle_timeout`       :: seconds a keep-alive connection may wait for its next
    #                           request before it is closed (default 5)
    # - `write_timeout`      :: seconds a client may leave a response write stuck
    #                           before the connection is dropped (default 30)
    # - `shutdown_timeout`   :: seconds {Server#stop} lets in-flight requests run
    #                           before they are cancelled (default 30)
    # - `request_timeout`    :: seconds a request may take from the end of its head
    #                           to the end of its response, else it is unwound at its
    #                           next wait and answered 503 (nil, the default: no limit;
    #                           see {Connection} and docs/server.md)
    Limits = Struct.new(:max_request_target, :max_header_bytes, :max_headers, :max_body,
                        :max_body_in_memory, :max_connections,
                        :header_timeout, :body_timeout, :min_body_rate, :idle_timeout, :write_timeout,
                        :shutdown_timeout, :request_timeout, keyword_init: true) do
      # @return [Hash{Symbol => Numeric}]
      def self.defaults
        { max_request_target: 8 * 1024, max_header_bytes: 64 * 1024, max_headers: 100,
          max_body: 10 * 1024 * 1024, max_body_in_memory: 64 * 1024, max_connections: default_max_connections,
          header_timeout: 10, body_timeout: 10, min_body_rate: 1024, idle_timeout: 5,
          write_timeout: 30, shutdown_timeout: 30, request_timeout: nil }
      end

      # @return [Integer] the `max_connections` default: 16,384, or the soft
      #   RLIMIT_NOFILE minus 128 when that is lower (at least 1), so that
      #   accepting never fails for want of descriptors.
      def self.default_max_connections
        soft, = Process.getrlimit(:NOFILE)
        (soft - 128).clamp(1, 16_384)
      end

      # @param options [Hash] any of the members; the rest take their defaults.
      # @return [Limits]
      # @raise [ArgumentError] for an unknown key or an invalid value.
      def self.build(options)
        unknown = options.keys - members
        raise ArgumentError, "unknown Server option(s): #{unknown.join(', ')} (known: #{members.join(', ')})" if unknown.any?

        values = defaults.merge(options)
        values[:request_timeout] = validate_request_timeout(values[:request_timeout])
        values.each do |key, value|
          if key == :request_timeout
            next
          elsif key == :min_body_rate
            NeverBlock.validate_size!(value, key, minimum: 0)
          elsif key.to_s.end_with?("timeout")
            NeverBlock.validate_timeout!(value, key)
          else
            NeverBlock.validate_size!(value, key)
          end
        end
        new(**values).freeze
      end

      # @return [Numeric, nil] `request_timeout` in seconds, nil when off
      #   (nil or false). Zero is refused: every request would fail.
      # @raise [ArgumentError] for anything but nil, false or a finite
      #   number of seconds > 0.
      def self.validate_request_timeout(value)
        return nil if value.nil? || value == false

        NeverBlock.validate_timeout!(value, :request_timeout)
        raise ArgumentError, "request_timeout must be > 0 seconds, or nil for none; got #{value.inspect}" if value.zero?

        value
      end
    end
  end
end
