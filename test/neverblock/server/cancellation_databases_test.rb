# frozen_string_literal: true

require_relative "server_helper"
require "securerandom"
require "pg"
require "trilogy"
require "neverblock/postgres"
require "neverblock/active_record"

# Cancellation down to the query on the database server (bin/test's
# PostgreSQL and MariaDB): a request's spawned queries are gone a second
# after its 503, and a client that hangs up has its request's query
# cancelled within about a second, through a NeverBlock pool and through
# the neverblock_postgresql and neverblock_trilogy ActiveRecord adapters.
class ServerCancellationDatabasesTest < PlainTest
  include ServerHelper
  include NeverBlockTest::Databases

  class PostgresRecord < ActiveRecord::Base
    self.abstract_class = true
  end

  class MySQLRecord < ActiveRecord::Base
    self.abstract_class = true
  end

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    @marker = "nb_cancel_#{SecureRandom.hex(4)}"
  end

  def teardown
    @sockets&.each { |socket| socket.close unless socket.closed? }
    super
  ensure
    [PostgresRecord, MySQLRecord].each do |record|
      record.connection_pool.disconnect! if record.connected?
      record.remove_connection
    end
    @pool&.close
    @pg_observer&.close
    @mysql_observer&.close
    NeverBlock.logger = @logger
  end

  # Queries carrying the marker that run on PostgreSQL now (seen from a
  # connection of the test's own, outside the server's loop).
  def postgres_running
    @pg_observer ||= PG.connect(**pg_conninfo)
    @pg_observer.exec_params("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1 " \
                             "AND pid <> pg_backend_pid()", ["%#{@marker}%"]).getvalue(0, 0).to_i
  end

  def mysql_running
    @mysql_observer ||= Trilogy.new(mysql_config)
    @mysql_observer.query("SELECT count(*) FROM information_schema.processlist WHERE info LIKE '%#{@marker}%' " \
                          "AND id <> CONNECTION_ID()").to_a.first.first.to_i
  end

  # Seconds until `running` reads 0 (fails past `limit`).
  def seconds_until_gone(limit: 10)
    started = now
    sleep 0.02 until yield.zero? || now - started > limit
    now - started
  end

  # An app that runs `sql` on a connection of `record`'s pool.
  def sleeping_app(record, sql)
    lambda do |_env|
      record.connection_pool.with_connection { |connection| [200, {}, [connection.select_value(sql).to_s]] }
    end
  end

  def hang_up_during(path, &running)
    socket = connect
    socket.write(get(path))
    eventually { yield == 1 }
    socket.close
    seconds = seconds_until_gone(&running)
    assert_operator seconds, :<, 3, "the query still ran #{seconds.round(2)} s after its client hung up"
    eventually { @server.stats[:requests_hung_up] == 1 }
  end

  def test_request_timeout_leaves_no_spawned_query_running
    @pool = NeverBlock::Postgres.pool(size: 3, **pg_conninfo)
    pool = @pool
    marker = @marker
    app = lambda do |_env|
      queries = Array.new(3) { NeverBlock.spawn { pool.exec("SELECT pg_sleep(8) /* #{marker} */") } }
      queries.each(&:wait)
      [200, { "content-length" => "3" }, ["ok\n"]]
    end
    start_server(app, request_timeout: 1)
    socket = connect
    socket.write(get("/"))
    status, = read_response(socket)
    assert_equal 503, status
    seconds = seconds_until_gone { postgres_running }
    assert_operator seconds, :<, 1, "pg_sleep still ran #{seconds.round(2)} s after the 503"
    eventually { pool.stats[:in_use].zero? } # every connection back in the pool
  end

  def test_a_hang_up_cancels_the_query_of_a_neverblock_pool
    @pool = NeverBlock::Postgres.pool(size: 1, **pg_conninfo)
    pool = @pool
    marker = @marker
    start_server(->(_env) { [200, {}, [pool.exec("SELECT pg_sleep(10) /* #{marker} */").first.to_s]] })
    hang_up_during("/") { postgres_running }
  end

  # A streaming body whose chunks each wait on a query a task of theirs
  # runs: the client's hang-up cancels the query, not just the next write.
  def test_a_hang_up_during_a_streamed_body_cancels_the_query_its_chunk_waits_on
    @pool = NeverBlock::Postgres.pool(size: 1, **pg_conninfo)
    pool = @pool
    marker = @marker
    body = Object.new
    body.define_singleton_method(:each) do |&write|
      write.call("first\n")
      3.times { write.call(NeverBlock.spawn { pool.exec("SELECT pg_sleep(10) /* #{marker} */") }.value.first.to_s) }
    end
    start_server(->(_env) { [200, { "content-type" => "text/plain" }, body] })
    hang_up_during("/") { postgres_running }
    eventually { pool.stats[:in_use].zero? }
  end

  def test_a_hang_up_cancels_the_query_of_neverblock_postgresql
    info = pg_conninfo
    PostgresRecord.establish_connection(adapter: "neverblock_postgresql", host: info[:host], port: info[:port],
                                        username: info[:user], password: info[:password], database: info[:dbname],
                                        pool: 1)
    start_server(sleeping_app(PostgresRecord, "SELECT pg_sleep(10) /* #{@marker} */"))
    hang_up_during("/") { postgres_running }
    # The pool's one connection is healthy for the next request.
    check = PostgresRecord.connection_pool.with_connection { |connection| connection.select_value("SELECT 1") }
    assert_equal 1, check
  end

  def test_a_hang_up_cancels_the_query_of_neverblock_trilogy
    config = mysql_config
    MySQLRecord.establish_connection(adapter: "neverblock_trilogy", host: config[:host], port: config[:port],
                                     username: config[:username], password: config[:password],
                                     database: config[:database], pool: 1)
    start_server(sleeping_app(MySQLRecord, "SELECT SLEEP(10) /* #{@marker} */"))
    hang_up_during("/") { mysql_running }
  end
end
