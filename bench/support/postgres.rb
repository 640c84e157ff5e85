# frozen_string_literal: true

require "open3"
require "tmpdir"

module NeverBlockBench
  # The PostgreSQL server the NEVERBLOCK_PG_* variables describe: bench/run
  # starts a throwaway one with bin/databases, which exports them; export
  # them yourself (and NEVERBLOCK_DATABASES=external) to use another.
  module PostgresServer
    VARIABLES = { "HOST" => :host, "PORT" => :port, "USER" => :user, "PASSWORD" => :password, "DATABASE" => :dbname }.freeze

    module_function

    # @return [String, nil] why the scripts cannot run
    def problem
      missing = VARIABLES.keys.map { |name| "NEVERBLOCK_PG_#{name}" }.select { |variable| ENV[variable].to_s.empty? }
      return nil if missing.empty?

      "no PostgreSQL server: #{missing.join(', ')} not set. Run the benchmark through bench/run " \
        "(it starts one with bin/databases), or export the NEVERBLOCK_PG_* variables of a server."
    end

    # @return [Hash{Symbol => String}] for PG.connect and NeverBlock::Postgres.pool
    def conninfo = VARIABLES.to_h { |name, key| [key, ENV.fetch("NEVERBLOCK_PG_#{name}")] }

    # @return [PG::Connection] a new connection; closed after the block when one is given
    def connect
      require "pg"
      conn = PG.connect(**conninfo)
      return conn unless block_given?

      begin
        yield conn
      ensure
        conn.close
      end
    end

    # The environment of libpq's own programs (pgbench, psql).
    def libpq_env = conninfo.to_h { |key, value| ["PG#{key == :dbname ? 'DATABASE' : key.upcase}", value.to_s] }

    # @return [String] e.g. "PostgreSQL 15.13 on 127.0.0.1:40213 (max_connections 300, fsync off)"
    def description
      settings = connect do |conn|
        conn.exec("SELECT current_setting('server_version') AS version, current_setting('max_connections') " \
                  "AS max_connections, current_setting('fsync') AS fsync").first
      end
      "PostgreSQL #{settings['version']} on #{conninfo[:host]}:#{conninfo[:port]} " \
        "(max_connections #{settings['max_connections']}, fsync #{settings['fsync']})"
    end

    # @return [String] e.g. "pg 1.7.0 (libpq 18.6)"
    def driver_description
      require "pg"
      "pg #{PG::VERSION} (libpq #{PG.library_version / 10_000}.#{PG.library_version % 10_000})"
    end
  end

  # `select $1` fanned out over NeverBlock tasks through a NeverBlock::Postgres pool.
  module PooledQueries
    SQL = "select $1"
    OPEN_SQL = "select pg_sleep(0.02)" # long enough that each task opening the pool holds a connection of its own
    WARM_UP = 500 # queries each measurement runs before its clock starts

    module_function

    # Opens the pool's connections from `tasks` tasks at once, before the clock starts (each costs milliseconds of SCRAM).
    def open_all(db, tasks) = NeverBlock.wait_all(Array.new(tasks) { NeverBlock.spawn { db.exec(OPEN_SQL) } })

    # `count` exec_params over `tasks` tasks, each running its share in order.
    def fan_out(db, count, tasks)
      NeverBlock.wait_all(NeverBlockBench.split(count, tasks).map { |share| NeverBlock.spawn { share.times { |i| db.exec_params(SQL, [i]) } } })
    end
  end

  # pgbench (C, libpq) on a custom script: the reference for a Ruby client's queries/s.
  module Pgbench
    module_function

    # @return [String, nil] $PGBENCH or the first pgbench on PATH (none in the Ruby 3.3 chroot)
    def executable
      [ENV.fetch("PGBENCH", nil), *ENV.fetch("PATH", "").split(File::PATH_SEPARATOR).map { |dir| File.join(dir, "pgbench") }]
        .compact.find { |path| File.file?(path) && File.executable?(path) }
    end

    # @return [String, nil] e.g. "pgbench (PostgreSQL) 15.13"
    def version
      output, status = Open3.capture2e(executable || (return nil), "--version")
      status.success? ? output.strip : nil
    end

    # @return [Float] transactions per second without connection time, of pgbench -M `mode` -c `clients`
    #   (as many threads, at most one per CPU) -t `transactions` (per client)
    def run(script, mode:, clients:, transactions:, env:, timeout: 120)
      Dir.mktmpdir("neverblock-pgbench") do |dir|
        File.write("#{dir}/script.sql", script)
        output, status = Open3.capture2e(env, "timeout", timeout.to_s, executable || raise("no pgbench"), "--no-vacuum",
                                         "-f", "#{dir}/script.sql", "-M", mode, "-c", clients.to_s,
                                         "-j", [clients, Etc.nprocessors].min.to_s, "-t", transactions.to_s)
        raise "pgbench failed (#{status}): #{output.lines.last(3).join.strip}" unless status.success?

        tps = output[/^tps = ([\d.]+) \(without initial connection time\)/, 1] or
          raise "pgbench printed no tps: #{output.lines.last(3).join.strip}"
        Float(tps)
      end
    end
  end
end
