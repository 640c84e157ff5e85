# frozen_string_literal: true

require "test_helper"
require "trilogy"
require "mysql2"
require "neverblock/mysql"

# Opening connections: bounded retries for a server that is down, none for
# a refusal that retrying cannot fix, and the loop left free while a
# connection is being opened (mysql2's blocking connect runs on the thread
# pool). Every test runs once per driver.
module MySQLConnectTests
  include NeverBlockTest::MySQLHelpers

  def test_a_server_that_is_down_raises_connect_error_after_bounded_retries
    db = NeverBlock::MySQL.pool(driver: driver, **mysql_config, port: closed_port, connect_retries: 2,
                                connect_backoff: 0.05)
    error = nil
    time = elapsed { error = assert_raises(NeverBlock::ConnectError) { db.query("SELECT 1") } }
    assert_operator time, :<, 2, "three refused attempts with 0.05 s and 0.1 s between them"
    assert_match(/cannot connect to mysql:\/\/#{mysql_config[:username]}@127\.0\.0\.1:\d+.*3 attempts/, error.message)
    assert_kind_of driver_error, error.cause
    assert_equal({ size: 12, in_use: 0, idle: 0, waiting: 0 }, db.stats, "the failed open gave its slot back")
  ensure
    db&.close
  end

  def test_a_wrong_password_raises_connect_error_at_once
    db = NeverBlock::MySQL.pool(driver: driver, **mysql_config, password: "wrong", connect_retries: 5,
                                connect_backoff: 1)
    error = nil
    time = elapsed { error = assert_raises(NeverBlock::ConnectError) { db.query("SELECT 1") } }
    assert_operator time, :<, 1, "a wrong password is not retried"
    assert_match(/not retried.*Access denied/, error.message)
    refute_includes error.message, "wrong", "the password is not in the message"
  ensure
    db&.close
  end

  def test_an_unknown_database_raises_connect_error_at_once
    db = NeverBlock::MySQL.pool(driver: driver, **mysql_config, database: "nb_no_such_database",
                                connect_retries: 5, connect_backoff: 1)
    error = nil
    time = elapsed { error = assert_raises(NeverBlock::ConnectError) { db.query("SELECT 1") } }
    assert_operator time, :<, 1
    assert_match(/Unknown database/, error.message)
  ensure
    db&.close
  end

  def test_the_loop_runs_while_a_connection_waits_for_a_silent_server
    silent = TCPServer.new("127.0.0.1", 0) # the kernel accepts; nobody ever answers
    db = NeverBlock::MySQL.pool(driver: driver, **mysql_config, port: silent.addr[1], connect_timeout: 1,
                                connect_retries: 0)
    ticks = 0
    ticker = NeverBlock.spawn { loop { sleep 0.01; ticks += 1 } }
    assert_raises(NeverBlock::ConnectError) { db.query("SELECT 1") }
    ticker.cancel
    ticker.wait
    assert_operator ticks, :>=, 50, "the loop was blocked while connecting"
  ensure
    db&.close
    silent&.close
  end

  def test_a_connection_that_opens_after_its_caller_gave_up_is_closed
    proxy = DelayingProxy.new(mysql_config, delay: 0.5)
    db = NeverBlock::MySQL.pool(driver: driver, **mysql_config, host: "127.0.0.1", port: proxy.port)
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.1) { db.query("SELECT 1") } }
    proxy.wait_until_clients_left
    assert_equal({ size: 12, in_use: 0, idle: 0, waiting: 0 }, db.stats)
  ensure
    db&.close
    proxy&.close
  end

  def test_a_url_with_options_in_its_query_string
    config = mysql_config
    url = "#{driver}://#{config[:username]}:#{config[:password]}@#{config[:host]}:#{config[:port]}/" \
          "#{config[:database]}?connect_timeout=3"
    db = NeverBlock::MySQL.pool(driver: driver, url: url)
    assert_equal 1, db.query("SELECT 1").count
  ensure
    db&.close
  end

  private

  # A TCP port on 127.0.0.1 where nothing listens.
  def closed_port
    server = TCPServer.new("127.0.0.1", 0)
    server.addr[1]
  ensure
    server&.close
  end

  # Forwards connections to the real server, each only after `delay`
  # seconds: a server slow to answer a new connection.
  class DelayingProxy
    attr_reader :port

    def initialize(config, delay:)
      @config = config
      @delay = delay
      @server = TCPServer.new("127.0.0.1", 0)
      @port = @server.addr[1]
      @open = 0
      @acceptor = NeverBlock.spawn { loop { serve(@server.accept) } }
    end

    # Waits until every client the proxy accepted has closed its connection.
    def wait_until_clients_left
      sleep 0.01 until @open.zero? && @served
    end

    def close
      @acceptor.cancel
      @acceptor.wait
      @server.close
    end

    private

    def serve(client)
      @open += 1
      @served = true
      NeverBlock.spawn do
        sleep @delay
        upstream = TCPSocket.new(@config[:host], @config[:port])
        pump = NeverBlock.spawn { IO.copy_stream(upstream, client) rescue nil } # rubocop:disable Style/RescueModifier
        IO.copy_stream(client, upstream) rescue nil # rubocop:disable Style/RescueModifier
        upstream.close_write rescue nil # rubocop:disable Style/RescueModifier
        pump.wait
      ensure
        upstream&.close
        client.close
        @open -= 1
      end
    end
  end
end

class MySQLConnectTrilogyTest < NeverBlockTest
  include MySQLConnectTests

  def driver
    :trilogy
  end
end

class MySQLConnectMysql2Test < NeverBlockTest
  include MySQLConnectTests

  def driver
    :mysql2
  end
end
