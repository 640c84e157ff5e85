# frozen_string_literal: true

require_relative "compat_helper"

# Database and cache clients against the servers bin/test starts, each call
# waiting 0.5 s on the server: pg_sleep, SLEEP, BLPOP with a timeout, and for
# memcached (which has no waiting command) a proxy that holds its answers.
# Each task opens its own connection, as a pool would lend one.
class CompatDatabasesTest < CompatTest
  include NeverBlockTest::Databases

  def test_pg
    require "pg"
    values = assert_concurrent_calls("pg", gem: "pg") do |index|
      connection = PG.connect(**pg_conninfo)
      connection.exec_params("SELECT pg_sleep($1), $2::int AS index", [DELAY, index]).getvalue(0, 1)
    ensure
      connection&.close
    end
    assert_equal indexes, values.map(&:to_i)
  end

  def test_mysql2
    require "mysql2"
    values = assert_concurrent_calls("mysql2", gem: "mysql2") do |index|
      client = Mysql2::Client.new(**mysql_config)
      client.query("SELECT SLEEP(#{DELAY}), #{index} AS i").first["i"]
    ensure
      client&.close
    end
    assert_equal indexes, values
  end

  def test_trilogy
    require "trilogy"
    values = assert_concurrent_calls("trilogy", gem: "trilogy") do |index|
      client = Trilogy.new(**mysql_config)
      client.query("SELECT SLEEP(#{DELAY}), #{index} AS i").to_a.first.last
    ensure
      client&.close
    end
    assert_equal indexes, values
  end

  # Sequel shares one Database and its pool between fibers with the
  # fiber_concurrency extension (a connection per fiber, not per thread).
  def test_sequel_with_fiber_concurrency
    require "sequel"
    Sequel.extension :fiber_concurrency
    db = Sequel.connect(pg_url, max_connections: CALLS, pool_timeout: 10, test: false)
    values = assert_concurrent_calls("Sequel (fiber_concurrency extension)", gem: "sequel") do |index|
      db.fetch("SELECT pg_sleep(?), CAST(? AS integer) AS index", DELAY, index).first[:index]
    end
    assert_equal indexes, values
  ensure
    db&.disconnect
  end

  def test_redis_client
    require "redis-client"
    values = assert_concurrent_calls("redis-client", gem: "redis-client") do |index|
      client = RedisClient.config(url: redis_url, read_timeout: 10).new_client
      client.call("BLPOP", "neverblock:compat:#{index}", DELAY).nil? && index
    ensure
      client&.close
    end
    assert_equal indexes, values
  end

  def test_redis
    require "redis"
    values = assert_concurrent_calls("redis", gem: "redis") do |index|
      redis = Redis.new(url: redis_url, read_timeout: 10)
      redis.blpop("neverblock:compat:#{index}", timeout: DELAY).nil? && index
    ensure
      redis&.close
    end
    assert_equal indexes, values
  end

  def test_dalli
    require "dalli"
    server = slow_proxy(*memcached_server.split(":"))
    Dalli::Client.new(memcached_server).set("neverblock:compat", "cached")
    values = assert_concurrent_calls("dalli (memcached)", gem: "dalli",
                                     note: "two exchanges a call, about 1 s: dalli asks memcached for its version " \
                                           "when it connects, then gets the value") do
      client = Dalli::Client.new(server, socket_timeout: 10)
      client.get("neverblock:compat")
    ensure
      client&.close
    end
    assert_equal ["cached"] * CALLS, values
  end

  private

  def indexes
    CALLS.times.to_a
  end
end
