# frozen_string_literal: true

require_relative "postgres"

module NeverBlockBench
  # The Rack 3 app every server in bench/server.rb runs (one process each):
  #
  #   GET /       "Hello world\n"
  #   GET /sleep  `sleep 0.01`, then "slept\n": a fiber sleep under NeverBlock
  #               and Falcon, a thread sleep under Puma
  #   GET /pg     `select pg_sleep(0.01)` through a database pool, then "slept\n"
  #
  # How /pg reaches PostgreSQL depends on the server, `db:`
  # - "neverblock": NeverBlock::Postgres.pool(size: db_pool), the library's own
  #   pool, under NeverBlock::Server;
  # - "fibers": a fair HandoffPool of `db_pool` pg connections, for Falcon (pg
  #   waits on its socket through async's fiber scheduler);
  # - "threads": one pg connection per server thread, as a threaded Rack app
  #   (or ActiveRecord's pool sized to the threads) would have, for Puma.
  # Connections open on first use (the benchmark warms up before measuring).
  # The database is the one the NEVERBLOCK_PG_* variables describe.
  class ServerApp
    HELLO = "Hello world\n"
    SLEPT = "slept\n"

    # @param db [String] "neverblock", "fibers" or "threads"
    # @param db_pool [Integer] connections for "neverblock" and "fibers"
    # @param sleep_seconds [Float] for /sleep and /pg
    def initialize(db: "threads", db_pool: 64, sleep_seconds: 0.01)
      @db = db
      @db_pool = db_pool
      @sleep_seconds = sleep_seconds
      @pg_sql = format("select pg_sleep(%.3f)", sleep_seconds)
      @lock = Thread::Mutex.new
      @pool = nil
    end

    # @param env [Hash] a Rack env
    # @return [Array(Integer, Hash, Array<String>)]
    def call(env)
      case env["PATH_INFO"]
      when "/" then text(HELLO)
      when "/sleep"
        sleep(@sleep_seconds)
        text(SLEPT)
      when "/pg"
        query(@pg_sql)
        text(SLEPT)
      else [404, { "content-type" => "text/plain", "content-length" => "10" }, ["not found\n"]]
      end
    end

    private

    def text(body)
      [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]]
    end

    def query(sql)
      case @db
      when "neverblock" then pool.exec(sql).clear
      when "fibers" then pool.with { |conn| conn.exec(sql).clear }
      else (Thread.current[:neverblock_bench_pg] ||= connect).exec(sql).clear
      end
    end

    # Created on first use, in the process that serves (after any fork).
    def pool
      @pool || @lock.synchronize do
        @pool ||=
          if @db == "neverblock"
            require "neverblock/postgres"
            NeverBlock::Postgres.pool(size: @db_pool, timeout: 30, **PostgresServer.conninfo)
          else
            require_relative "handoff_pool"
            HandoffPool.new(size: @db_pool) { connect }
          end
      end
    end

    def connect
      require "pg"
      PG.connect(**PostgresServer.conninfo)
    end
  end
end
