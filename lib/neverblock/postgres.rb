# frozen_string_literal: true

require "pg"

require_relative "../neverblock"
require_relative "connection_pool"
require_relative "connector"
require_relative "isolation"
require_relative "postgres/recovery"
require_relative "postgres/connection"
require_relative "postgres/lane"
require_relative "postgres/client"

module NeverBlock
  # PostgreSQL through the pg gem (>= 1.5), concurrently: a pool-backed
  # {Postgres::Client} whose queries suspend only the calling fiber inside
  # NeverBlock (pg waits on its socket through Ruby's fiber scheduler) and
  # block the thread elsewhere.
  #
  #   require "neverblock/postgres"
  #
  #   DB = NeverBlock::Postgres.pool(size: 12, host: "127.0.0.1", dbname: "app", user: "app")
  #   NeverBlock.run do
  #     10.times.map { NeverBlock.spawn { DB.exec("select pg_sleep(1)") } }.each(&:value) # ~1 s
  #   end
  #
  # What it adds to pg:
  # - a {ConnectionPool} (FIFO waiters, checkout timeout, broken connections
  #   replaced, fresh connections in forked children);
  # - server-side cancel: a query interrupted by {NeverBlock.timeout},
  #   `Timeout.timeout` or {Task#cancel} is cancelled on the server and its
  #   connection goes back to the pool clean;
  # - pipelining (`pipeline: true`): statements from many fibers share each
  #   connection through libpq's pipeline mode;
  # - connecting with bounded retries ({ConnectError} when the server stays
  #   down; at once for a wrong password).
  module Postgres
    # Options of {.pool} that are not libpq connection parameters.
    POOL_OPTIONS = %i[size timeout pipeline pipeline_depth connect_retries connect_backoff url].freeze

    # Libpq connect_timeout (seconds) used unless one is given.
    DEFAULT_CONNECT_TIMEOUT = 5

    # Connection failures worth another attempt: the server is down,
    # starting, stopping or full. Anything else (a wrong password, an unknown
    # database or role, no pg_hba.conf entry) fails at once.
    RETRYABLE = Regexp.union(
      /could not connect/i, /connection refused/i, /no such file or directory/i,
      /the database system is (starting up|shutting down|in recovery mode|not yet accepting)/i,
      /too many clients/i, /remaining connection slots/i, /timeout expired/i,
      /server closed the connection unexpectedly/i, /could not receive data/i, /network is unreachable/i,
      # A server starting or stopping resets connections (libpq: "could not
      # send startup packet: Connection reset by peer").
      /connection reset by peer/i, /could not send (?:startup|SSL negotiation) packet/i
    )

    class << self
      # A pool-backed client.
      #
      # @param size [Integer] connections at most (default 12).
      # @param timeout [Numeric] seconds a caller waits for a free connection
      #   before {PoolTimeout} (default 5).
      # @param pipeline [Boolean] multiplex statements from many fibers over
      #   each connection (libpq pipeline mode; default false).
      # @param pipeline_depth [Integer] statements in flight on a pipelined
      #   connection before another connection is opened (default 16): deeper
      #   queues batch more, more connections run more statements at once.
      # @param connect_retries [Integer] attempts after the first when the
      #   server cannot be reached (default 3; backoff 0.1, 0.2, 0.4 s...).
      # @param connect_backoff [Numeric] seconds before the first retry.
      # @param url [String, nil] a `postgres://` URL; keywords override it.
      # @param conninfo [Hash] libpq connection parameters (host:, port:,
      #   dbname:, user:, password:, sslmode:, connect_timeout:, ...).
      # @param opentelemetry [Boolean] a client span per statement (see
      #   {NeverBlock::Telemetry.query_span}); needs OpenTelemetry's API
      #   loaded. Off by default (opentelemetry-instrumentation-pg makes its own).
      # @return [Client]
      # @raise [ArgumentError] for a bad size or timeout, or opentelemetry
      #   without OpenTelemetry.
      def pool(size: 12, timeout: 5, pipeline: false, pipeline_depth: 16, connect_retries: 3,
               connect_backoff: 0.1, url: nil, opentelemetry: false, **conninfo)
        connector = connector(url: url, retries: connect_retries, backoff: connect_backoff, **conninfo)
        Client.new(connector, size: size, timeout: timeout, pipeline: pipeline,
                              pipeline_depth: pipeline_depth, opentelemetry: opentelemetry)
      end

      # A {Connector} that opens {Connection}s (asynchronously: pg connects
      # through the fiber scheduler) with retries.
      #
      # @param url [String, nil]
      # @param retries [Integer]
      # @param backoff [Numeric]
      # @param conninfo [Hash] libpq connection parameters.
      # @return [Connector]
      def connector(url: nil, retries: 3, backoff: 0.1, **conninfo)
        params = {}
        params.merge!(PG::Connection.conninfo_parse(url).to_h { |opt| [opt[:keyword].to_sym, opt[:val]] }.compact) if url
        params.merge!(conninfo.transform_keys(&:to_sym))
        params[:connect_timeout] ||= DEFAULT_CONNECT_TIMEOUT
        Connector.new(-> { describe(params) }, errors: [PG::ConnectionBad], retryable: method(:retryable?),
                                               retries: retries, backoff: backoff) do
          Connection.new(params)
        end
      end

      # @param error [PG::ConnectionBad]
      # @return [Boolean] whether connecting again may succeed.
      def retryable?(error)
        message = error.message.to_s
        return false if message.match?(/authentication failed|does not exist|no pg_hba\.conf entry|permission denied/i)

        message.match?(RETRYABLE)
      end

      private

      # The server as libpq resolves it when it connects, as a libpq URI
      # (`psql` takes it): the parameters given (as pg passes them: `host:
      # nil` is an empty host, the default Unix socket), else the PG*
      # environment variables (PGHOST, PGPORT, PGUSER, PGDATABASE...), else
      # libpq's defaults (port 5432, the OS user, the default Unix socket);
      # never the password. `postgres://app@127.0.0.1:4198/app`,
      # `postgres://app@/app?host=/var/run/postgresql&port=5432`. (A
      # `service:` given as a parameter is not looked up.)
      def describe(params)
        given = begin
          PG::Connection.conninfo_parse(PG::Connection.parse_connect_args(params))
                        .to_h { |option| [option[:keyword].to_sym, option[:val]] }.compact
        rescue PG::Error # a parameter libpq does not know: the connect failed on it, and its error says so
          params.compact
        end
        settings = PG::Connection.conndefaults_hash.compact.merge(given)
        value = ->(key) { settings[key].to_s unless settings[key].to_s.empty? }
        user = value[:user]
        host = value[:host]
        hostaddr = value[:hostaddr]
        port = value[:port] || "5432"
        query = []
        if host.nil? && hostaddr.nil? || host&.split(",", -1)&.any? { |name| name.empty? || name.start_with?("/", "@") }
          authority = "" # a Unix socket: libpq's URI names it in the query
          query << "host=#{host}" if host
          query << "port=#{port}"
        else
          ports = port.split(",", -1).map { |each| each.empty? ? "5432" : each }
          authority = (host || hostaddr).split(",", -1).each_with_index.map do |name, index|
            "#{name}:#{ports[index] || ports.last}"
          end.join(",")
        end
        query << "hostaddr=#{hostaddr}" if host && hostaddr
        "postgres://#{"#{user}@" if user}#{authority}/#{value[:dbname] || user}#{"?#{query.join('&')}" unless query.empty?}"
      end
    end
  end
end
