# frozen_string_literal: true

require_relative "postgres"
require_relative "ruby_description"

module NeverBlockBench
  # The Rack app of every server in bench/server.rb:
  #
  #   GET /       "Hello world\n"
  #   GET /sleep  `sleep 0.01` (a fiber's under NeverBlock and Falcon, a thread's under Puma), "slept\n"
  #   GET /pg     `select pg_sleep(0.01)` through a database pool, "slept\n"
  #   GET /ruby   the serving Ruby (PeerServers.check_ruby)
  #
  # /sleep and /pg mark the request IO-bound for Puma 8's IO mode. `db:` says
  # how /pg reaches PostgreSQL: "neverblock", NeverBlock::Postgres.pool(size:
  # db_pool); "fibers", a FairPool of db_pool connections (Falcon); "threads",
  # a connection per server thread (Puma). Connections open on first use.
  class ServerApp
    HELLO = "Hello world\n"
    SLEPT = "slept\n"

    def initialize(db: "threads", db_pool: 64, sleep_seconds: 0.01)
      @db = db
      @db_pool = db_pool
      @sleep_seconds = sleep_seconds
      @pg_sql = format("select pg_sleep(%.3f)", sleep_seconds)
      @lock = Thread::Mutex.new
      @pool = nil
    end

    def call(env)
      case env["PATH_INFO"]
      when "/" then text(HELLO)
      when "/sleep"
        env["puma.mark_as_io_bound"]&.call
        sleep(@sleep_seconds)
        text(SLEPT)
      when "/pg"
        env["puma.mark_as_io_bound"]&.call
        query(@pg_sql)
        text(SLEPT)
      when "/ruby" then text(NeverBlockBench.ruby_description)
      else [404, { "content-type" => "text/plain", "content-length" => "10" }, ["not found\n"]]
      end
    end

    private

    def text(body) = [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]]

    def query(sql)
      case @db
      when "neverblock" then pool.exec(sql).clear
      when "fibers" then pool.with { |conn| conn.exec(sql).clear }
      else (Thread.current[:neverblock_bench_pg] ||= PostgresServer.connect).exec(sql).clear
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
            FairPool.new(@db_pool) { PostgresServer.connect }
          end
      end
    end
  end

  # Falcon's database pool: `size` connections, opened at once. A fiber that
  # finds none idle waits on a Thread::Queue of its own (Queue#pop suspends
  # only that fiber under a fiber scheduler), and a connection given back goes
  # to the one that has waited longest: a newcomer cannot overtake it.
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
      @lock.synchronize { (longest = @waiters.shift) ? longest.push(connection) : @idle.push(connection) } if connection
    end
  end

  # A server's allocation count, asked from outside: {.serve} (in the server,
  # a thread blocked in accept, off the requests' path) answers each
  # connection to a Unix socket with GC.stat(:total_allocated_objects).
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
