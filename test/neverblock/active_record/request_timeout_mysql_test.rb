# frozen_string_literal: true

require_relative "../server/server_helper"
require "neverblock/active_record"
require "trilogy"

# The server's request_timeout over ActiveRecord on MariaDB (bin/test's),
# with each NeverBlock MySQL adapter: a request inside a transaction that
# inserted a row and then waits in SLEEP(10) is answered 503 in about a
# second, the query is killed on the server, the row is rolled back, and
# the pool's one connection answers the next request. Unlike PostgreSQL's
# (whose session survives a cancel: rails_app_test.rb runs the same there,
# through a Rails app), it may be a new session: ActiveRecord reconnects a
# MySQL connection that was interrupted mid-query.
class ActiveRecordRequestTimeoutMySQLTest < PlainTest
  include ServerHelper
  include NeverBlockTest::Databases

  class Record < ActiveRecord::Base
    self.abstract_class = true
  end

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    @observer = Trilogy.new(mysql_config) # outside the server's loop: it blocks this thread only
    @observer.query("DROP TABLE IF EXISTS nb_rt_rows")
    @observer.query("CREATE TABLE nb_rt_rows (id INT AUTO_INCREMENT PRIMARY KEY, note VARCHAR(16)) ENGINE=InnoDB")
  end

  def teardown
    @sockets&.each { |socket| socket.close unless socket.closed? }
    super
  ensure
    Record.connection_pool.disconnect! if Record.connected?
    Record.remove_connection
    @observer&.query("DROP TABLE IF EXISTS nb_rt_rows")
    @observer&.close
    NeverBlock.logger = @logger
  end

  # /doomed: the transaction that waits 10 s; /id: the connection's id.
  def app
    lambda do |env|
      Record.connection_pool.with_connection do |connection|
        id = connection.select_value("SELECT CONNECTION_ID()")
        if env["PATH_INFO"] == "/doomed"
          connection.transaction do
            connection.execute("INSERT INTO nb_rt_rows (note) VALUES ('doomed')")
            connection.execute("SELECT SLEEP(10) /* nb_rt_doomed */")
          end
        end
        [200, { "content-type" => "text/plain" }, ["#{id}\n"]]
      end
    end
  end

  %w[neverblock_trilogy neverblock_mysql2].each do |adapter|
    define_method(:"test_request_timeout_kills_the_query_and_rolls_back_on_#{adapter}") do
      config = mysql_config
      Record.establish_connection(adapter: adapter, host: config[:host], port: config[:port],
                                  username: config[:username], password: config[:password],
                                  database: config[:database], pool: 1, checkout_timeout: 5)
      start_server(app, request_timeout: 1)
      socket = connect
      socket.write(get("/id"))
      status, _headers, body = read_response(socket)
      assert_equal 200, status, body

      doomed = connect
      doomed.write(get("/doomed"))
      status = nil
      took = elapsed { status, = read_response(doomed) }
      assert_equal 503, status
      assert_operator took, :<, 5, "the 503 took #{took.round(2)} s"

      running = nil
      eventually do
        running = @observer.query("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE INFO LIKE " \
                                  "'%nb_rt_doomed%' AND INFO NOT LIKE '%PROCESSLIST%'").rows.first.first
        running.zero?
      end
      assert_equal 0, @observer.query("SELECT COUNT(*) FROM nb_rt_rows").rows.first.first, "the insert was rolled back"
      socket.write(get("/id"))
      status, _headers, body = read_response(socket)
      assert_equal 200, status, "the pool's one connection answers the next request: #{body}"
      assert_equal 1, Record.connection_pool.stat[:size]
      assert_match(%r{GET /doomed timed out after 1\.\d+ s}, @log.string)
    end
  end
end
