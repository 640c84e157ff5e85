# frozen_string_literal: true

require "openssl"
require "uri"

module NeverBlock
  class Server
    # TLS for `ssl://` binds, as Puma spells them:
    # `ssl://HOST:PORT?cert=PATH&key=PATH`.
    #
    # The query takes:
    # - `cert` :: PEM file with the server's certificate, followed by any
    #   intermediate certificates (required);
    # - `key` :: PEM file with its private key (required);
    # - `key_password` :: the key's passphrase, if it is encrypted;
    # - `min_version` :: `TLS1_2` (default) or `TLS1_3`.
    #
    # Files are read once, when the server is created (in the master, before
    # workers fork). Each connection's handshake runs in that connection's
    # own fiber, bounded by `header_timeout`, holding no request slot: a
    # slow or silent client delays nobody. A client that does not speak TLS
    # (plain HTTP on the TLS port) is disconnected. ALPN offers `http/1.1`.
    module TLS
      PARAMETERS = %w[cert key key_password min_version].freeze
      VERSIONS = { "TLS1_2" => OpenSSL::SSL::TLS1_2_VERSION, "TLS1_3" => OpenSSL::SSL::TLS1_3_VERSION }.freeze

      module_function

      # @param spec [String] the whole bind spec, for messages.
      # @param query [String, nil] the part after `?`.
      # @return [OpenSSL::SSL::SSLContext] set up (frozen).
      # @raise [ArgumentError] for a missing or unknown parameter, a file
      #   that cannot be read or parsed, or a key that does not match the
      #   certificate.
      def context(spec, query)
        params = URI.decode_www_form(query.to_s).to_h
        unknown = params.keys - PARAMETERS
        raise ArgumentError, "#{spec}: unknown TLS parameter(s) #{unknown.join(', ')} (known: #{PARAMETERS.join(', ')})" if unknown.any?

        %w[cert key].each do |name|
          raise ArgumentError, "#{spec}: ssl:// needs #{name}=PATH (ssl://HOST:PORT?cert=PATH&key=PATH)" unless params[name]
        end
        certificates = read_certificates(spec, params["cert"])
        key = read_key(spec, params["key"], params["key_password"])
        build(spec, certificates, key, params.fetch("min_version", "TLS1_2"))
      end

      # The bind spec with relative `cert` and `key` paths made absolute
      # against `base` (the server may run from another directory: `neverblock
      # serve` changes to the config.ru's).
      # @return [String] any other spec unchanged.
      def expand_paths(spec, base)
        address, query = spec.split("?", 2)
        return spec unless address.start_with?("ssl://") && query

        params = URI.decode_www_form(query).map do |name, value|
          %w[cert key].include?(name) ? [name, File.expand_path(value, base)] : [name, value]
        end
        "#{address}?#{URI.encode_www_form(params)}"
      end

      # Runs the server side of the handshake on an accepted socket, waiting
      # (only the calling fiber) until `deadline` on the monotonic clock.
      # @return [Socket, nil] the TLS connection, or nil when the handshake
      #   failed or timed out (the raw socket is left for the caller to close).
      def accept(raw, context, deadline)
        ssl = OpenSSL::SSL::SSLSocket.new(raw, context)
        loop do
          state = ssl.accept_nonblock(exception: false)
          return Socket.new(ssl) if state.equal?(ssl)

          remaining = deadline - Clock.now
          return nil unless remaining.positive?

          ready = state == :wait_readable ? raw.wait_readable(remaining) : raw.wait_writable(remaining)
          return nil unless ready
        end
      rescue OpenSSL::SSL::SSLError, SystemCallError, IOError => e
        NeverBlock.logger.debug("NeverBlock::Server") { "TLS handshake failed: #{e.class}: #{e.message}" }
        nil
      end

      def read_certificates(spec, path)
        pem = File.read(path)
        certificates = pem.scan(/-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----/m)
                          .map { |block| OpenSSL::X509::Certificate.new(block) }
        raise ArgumentError, "#{spec}: #{path} holds no PEM certificate" if certificates.empty?

        certificates
      rescue SystemCallError, OpenSSL::X509::CertificateError => e
        raise ArgumentError, "#{spec}: cannot read the certificate #{path}: #{e.message}"
      end

      def read_key(spec, path, password)
        OpenSSL::PKey.read(File.read(path), password.to_s)
      rescue SystemCallError, OpenSSL::PKey::PKeyError => e
        raise ArgumentError, "#{spec}: cannot read the private key #{path}: #{e.message}" \
                             "#{' (encrypted? give key_password=...)' if e.is_a?(OpenSSL::PKey::PKeyError) && !password}"
      end

      def build(spec, certificates, key, min_version)
        context = OpenSSL::SSL::SSLContext.new
        context.min_version = VERSIONS.fetch(min_version) do
          raise ArgumentError, "#{spec}: min_version must be one of #{VERSIONS.keys.join(', ')}"
        end
        begin
          context.add_certificate(certificates.first, key, certificates.drop(1))
        rescue OpenSSL::SSL::SSLError, ArgumentError => e
          raise ArgumentError, "#{spec}: the key does not go with the certificate (#{e.message})"
        end
        context.alpn_select_cb = ->(protocols) { protocols.include?("http/1.1") ? "http/1.1" : nil }
        context.session_id_context = "neverblock"
        context.freeze # (OpenSSL's SSLContext#freeze is #setup, which returns true)
        context
      end

      # An accepted TLS connection, with the methods {Connection} and
      # {Response} use on a plain socket. Decrypted bytes may wait in
      # OpenSSL's buffer while the socket has none, so #wait_readable looks
      # there first.
      class Socket
        # @return [OpenSSL::SSL::SSLSocket] what `rack.hijack` hands the app.
        attr_reader :ssl

        def initialize(ssl)
          @ssl = ssl
          @io = ssl.to_io
        end

        # @return [String, Symbol, nil] as IO#read_nonblock(exception: false).
        def read_nonblock(size, buffer, exception: false)
          loop do
            data = @ssl.read_nonblock(size, buffer, exception: exception)
            return data unless data == :wait_writable # a TLS 1.3 key update wants to write first

            @io.wait_writable
          end
        rescue OpenSSL::SSL::SSLError => e
          raise IOError, "TLS: #{e.message}"
        end

        # @return [Integer, Symbol] bytes written, or :wait_writable.
        def write_nonblock(data, exception: false)
          written = @ssl.write_nonblock(data, exception: exception)
          written == :wait_readable ? :wait_writable : written
        rescue OpenSSL::SSL::SSLError => e
          raise IOError, "TLS: #{e.message}"
        end

        # @return [Object, nil] truthy once there is something to read.
        def wait_readable(timeout = nil)
          @ssl.pending.positive? ? self : @io.wait_readable(timeout)
        end

        # @return [Object, nil] truthy once the socket takes more bytes.
        def wait_writable(timeout = nil)
          @io.wait_writable(timeout)
        end

        # Stops sending (the TCP half-close; no close_notify): the
        # connection is ending.
        def close_write
          @io.close_write
        end

        def close
          @io.close
        end

        def closed?
          @io.closed?
        end

        def setsockopt(...)
          @io.setsockopt(...)
        end

        def remote_address
          @io.remote_address
        end

        def local_address
          @io.local_address
        end

        # @return [IO] the TCP socket underneath.
        def to_io
          @io
        end
      end
    end
  end
end
