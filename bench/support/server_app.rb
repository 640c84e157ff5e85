# frozen_string_literal: true

require_relative "postgres"

module NeverBlockBench
  # @return [String] this Ruby and whether YJIT is on in it, e.g. "ruby 3.4.5 ... yjit=true\n"
  def self.ruby_description = "#{RUBY_DESCRIPTION} yjit=#{yjit?}\n"

  def self.yjit? = defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled? ? true : false

  # The Rack 3 app every server in bench/server.rb runs (one process each):
  #
  #   GET /       "Hello world\n"
  #   GET /sleep  `sleep 0.01`, then "slept\n": a fiber sleep under NeverBlock
  #               and Falcon, a thread sleep under Puma
  #   GET /pg     `select pg_sleep(0.01)` through a database pool, then "slept\n"
  #   GET /ruby   the serving Ruby (PeerServers.check_ruby: is YJIT on in it?)
  # /sleep and /pg first mark the request as IO-bound for Puma 8's IO mode
  # (env["puma.mark_as_io_bound"]; see puma_io.rb).
  #
  # How /pg reaches PostgreSQL depends on the server, `db:`
  # - "neverblock": NeverBlock::Postgres.pool(size: db_pool), the library's own
  #   pool, under NeverBlock::Server;
  # - "fibers": a FairPool of `db_pool` pg connections, for Falcon (pg waits
  #   on its socket through async's fiber scheduler);
  # - "threads": one pg connection per server thread, as a threaded Rack app
  #   (or ActiveRecord's pool sized to the threads) would have, for Puma.
  # Connections open on first use (the benchmark warms up before measuring).
  # The database is the one the NEVERBLOCK_PG_* variables describe.
  # NB_BENCH_GC_SOCKET=PATH (given to NeverBlock) has the process answer its
  # allocation count on a Unix socket (GcProbe).
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
        mark_as_io_bound(env)
        sleep(@sleep_seconds)
        text(SLEPT)
      when "/pg"
        mark_as_io_bound(env)
        query(@pg_sql)
        text(SLEPT)
      when "/ruby" then text(NeverBlockBench.ruby_description)
      else [404, { "content-type" => "text/plain", "content-length" => "10" }, ["not found\n"]]
      end
    end

    private

    # Tells Puma 8 the request waits on IO, so that its IO mode (max_io_threads)
    # lets it run beyond the `threads` maximum; nil under every other server.
    def mark_as_io_bound(env) = env["puma.mark_as_io_bound"]&.call

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
            FairPool.new(@db_pool) { connect }
          end
      end
    end

    def connect
      require "pg"
      PG.connect(**PostgresServer.conninfo)
    end
  end

  # Falcon's database pool: `size` connections, opened at once. A fiber that
  # finds none idle waits in line on a Thread::Queue of its own (Queue#pop
  # suspends only that fiber under a fiber scheduler), and a connection given
  # back goes straight to the one that has waited longest: a newcomer cannot
  # overtake it, as it could a plain Queue's waiters.
  class FairPool
    def initialize(size, &connect)
      @idle = Array.new(size) { connect.call }
      @waiters = []
      @lock = Thread::Mutex.new
    end

    # Lends a connection to the block.
    def with
      waiter = nil
      connection = @lock.synchronize do
        next @idle.pop unless @idle.empty?

        @waiters << (waiter = Thread::Queue.new)
        nil
      end
      connection ||= waiter.pop
      yield connection
    ensure
      checkin(connection) if connection
    end

    private

    def checkin(connection)
      @lock.synchronize do
        waiter = @waiters.shift
        waiter ? waiter.push(connection) : @idle.push(connection)
      end
    end
  end

  # A server's allocation count, asked from outside it: {.serve} (in the
  # server, from a thread blocked in accept, off the requests' path) answers
  # each connection to a Unix socket with GC.stat(:total_allocated_objects).
  module GcProbe
    def self.serve(path)
      require "socket"
      listener = UNIXServer.new(path)
      Thread.new { loop { listener.accept.tap { |client| client.write("#{GC.stat(:total_allocated_objects)}\n") }.close } }
    end

    # @return [Integer, nil] nil when the server does not answer
    def self.read(path)
      UNIXSocket.open(path) { |socket| Integer(socket.read, exception: false) }
    rescue SystemCallError
      nil
    end
  end
end
