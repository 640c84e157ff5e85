# frozen_string_literal: true

module NeverBlockBench
  # The PostgreSQL server that bench/db.rb and bench/activerecord.rb talk
  # to, as the NEVERBLOCK_PG_* variables describe it. `bench/run db` and
  # `bench/run activerecord` start a throwaway server with bin/databases,
  # which exports them; exporting them yourself (and
  # NEVERBLOCK_DATABASES=external for bench/run) points the scripts at
  # another server.
  module PostgresServer
    # NEVERBLOCK_PG_<NAME> => libpq connection parameter.
    VARIABLES = { "HOST" => :host, "PORT" => :port, "USER" => :user, "PASSWORD" => :password,
                  "DATABASE" => :dbname }.freeze

    module_function

    # @return [Array<String>] the variables that are not set
    def missing
      VARIABLES.keys.map { |name| "NEVERBLOCK_PG_#{name}" }.reject { |variable| ENV[variable].to_s != "" }
    end

    # @return [String, nil] why the scripts cannot run, or nil when they can
    def problem
      return nil if missing.empty?

      "no PostgreSQL server: #{missing.join(', ')} not set. Run the benchmark through bench/run " \
        "(it starts one with bin/databases), or export the NEVERBLOCK_PG_* variables of a server."
    end

    # @return [Hash{Symbol => String}] libpq connection parameters, for
    #   PG.connect and NeverBlock::Postgres.pool
    def conninfo
      VARIABLES.to_h { |name, key| [key, ENV.fetch("NEVERBLOCK_PG_#{name}")] }
    end

    # @param adapter [String] "postgresql" or "neverblock_postgresql"
    # @param pool [Integer] connections at most
    # @return [Hash] an ActiveRecord database configuration
    def active_record_config(adapter:, pool:)
      info = conninfo
      { adapter: adapter, host: info[:host], port: Integer(info[:port]), username: info[:user],
        password: info[:password], database: info[:dbname], pool: pool }
    end

    # The environment libpq's own programs (pgbench, psql) read.
    # @return [Hash{String => String}]
    def libpq_env
      info = conninfo
      { "PGHOST" => info[:host], "PGPORT" => info[:port].to_s, "PGUSER" => info[:user],
        "PGPASSWORD" => info[:password], "PGDATABASE" => info[:dbname] }
    end

    # Connects once (loads pg) and asks the server what it is.
    # @return [String] e.g. "PostgreSQL 15.13 on 127.0.0.1:40213 (max_connections 300, fsync off)"
    def description
      require "pg"
      conn = PG.connect(**conninfo)
      begin
        settings = conn.exec("SELECT current_setting('server_version') AS version, " \
                             "current_setting('max_connections') AS max_connections, " \
                             "current_setting('fsync') AS fsync").first
        "PostgreSQL #{settings['version']} on #{conninfo[:host]}:#{conninfo[:port]} " \
          "(max_connections #{settings['max_connections']}, fsync #{settings['fsync']})"
      ensure
        conn.close
      end
    end

    # @return [String] e.g. "pg 1.7.0 (libpq 18.6)"
    def driver_description
      require "pg"
      # PQlibVersion: major * 10000 + minor since PostgreSQL 10.
      version = PG.library_version
      "pg #{PG::VERSION} (libpq #{version / 10_000}.#{version % 10_000})"
    end
  end

  # What bench/db.rb and bench/activerecord.rb do before measuring; included
  # in a benchmark class with @options[:selector] and a `header` method.
  module PostgresBench
    private

    # Checks the server, sets and probes the selector, prints the header; sets @selector and @probe.
    # @return [Boolean] false, after a warning, when nothing can be measured
    def ready_to_measure?
      return warn(PostgresServer.problem) && false if PostgresServer.problem

      @selector = Peers.use_selector(@options[:selector])
      @probe = Peers.probe
      puts header
      return true unless @probe.is_a?(Isolated::Failure) || @probe.neverblock_selector != @selector

      warn "NeverBlock does not run on the #{@selector} selector (see above); not measuring"
      false
    end

    def versions_text
      return "neverblock (version unknown, the probe failed)" if @probe.is_a?(Isolated::Failure)

      "neverblock #{@probe.neverblock}, io-event #{@probe.io_event}"
    end
  end
end
