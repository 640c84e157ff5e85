# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "trilogy"
require "mysql2"
require "neverblock/mysql"

# What happens to a query and its pooled connection when the caller gives up
# half-way (a timeout, a cancellation) or the server ends the session: the
# query stops on the server (KILL QUERY), and the pool goes on with a clean
# connection — the same one with mysql2, a new one with trilogy, which
# closes its socket when interrupted. A second session watches
# information_schema.PROCESSLIST to see it from the server's side.
module MySQLRecoveryTests
  include NeverBlockTest::MySQLHelpers

  def test_a_neverblock_timeout_kills_the_query_on_the_server
    db = client
    id = connection_id(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.5) { db.query(sleep_sql(marker)) } }
    assert_equal id, watcher.value, "the query did run on the server, in the pooled session"
    assert_stops_on_the_server(marker)
    assert_connection_after_interrupt(db, id)
  end

  def test_a_stdlib_timeout_kills_the_query_on_the_server
    db = client
    id = connection_id(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(Timeout::Error) { Timeout.timeout(0.5) { db.query(sleep_sql(marker)) } }
    watcher.value
    assert_stops_on_the_server(marker)
    assert_connection_after_interrupt(db, id)
  end

  def test_cancelling_a_task_kills_its_query_on_the_server
    db = client
    id = connection_id(db)
    marker = unique_name("sleep")
    task = NeverBlock.spawn { db.query(sleep_sql(marker)) }
    watch_for(marker).value
    task.cancel
    assert_raises(NeverBlock::Cancelled) { task.value }
    assert_stops_on_the_server(marker)
    assert_connection_after_interrupt(db, id)
  end

  def test_the_drivers_read_timeout_kills_the_query_on_the_server
    db = client(read_timeout: 1)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    error = assert_raises(driver_error) { db.query(sleep_sql(marker)) }
    assert_match(/timeout|timed out/i, "#{error.class} #{error.message}")
    watcher.value
    assert_stops_on_the_server(marker)
    assert_equal [[1]], rows(db.query("SELECT 1"))
  end

  def test_a_timeout_during_a_query_on_the_raw_connection_kills_it_on_the_server
    db = client
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.5) { db.with { |conn| conn.query(sleep_sql(marker)) } }
    end
    watcher.value
    assert_stops_on_the_server(marker)
    assert_equal({ size: 1, in_use: 0, idle: 0, waiting: 0 }, db.stats, "the driver closed its socket: replaced")
    assert_equal [[1]], rows(db.query("SELECT 1"))
  end

  def test_a_timeout_inside_a_transaction_rolls_it_back
    db = client
    table = create_table(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.5) do
        db.transaction do |conn|
          conn.query("INSERT INTO #{table} VALUES (1)")
          conn.query(sleep_sql(marker))
        end
      end
    end
    watcher.value
    assert_stops_on_the_server(marker)
    assert_equal [[0]], rows(db.query("SELECT @@in_transaction"))
    assert_equal 0, with_admin { |admin| admin.query("SELECT COUNT(*) FROM #{table}").rows.first.first }
  end

  def test_a_connection_goes_back_to_the_pool_even_when_interrupts_keep_arriving_during_recovery
    db = client
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.3) do
        NeverBlock.timeout(0.2) { NeverBlock.timeout(0.1) { db.query("SELECT SLEEP(30)") } }
      end
    end
    assert_equal 0, db.stats[:in_use], "closed or clean, the connection must not stay checked out by nobody"
    assert_equal [[1]], rows(db.query("SELECT 1"))
  end

  def test_killing_a_busy_connections_thread_fails_that_call_and_the_next_call_gets_a_fresh_connection
    db = client
    marker = unique_name("sleep")
    busy = NeverBlock.spawn do
      db.query(sleep_sql(marker))
    rescue driver_error => e
      e
    end
    id = watch_for(marker).value
    with_admin { |admin| admin.query("KILL #{id}") }
    assert_kind_of driver_error, busy.value
    refute_equal id, connection_id(db)
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
  end

  def test_a_connection_killed_while_idle_is_replaced_before_the_next_call
    db = client
    id = connection_id(db)
    with_admin do |admin|
      admin.query("KILL #{id}")
      wait_until("the session to end") do
        admin.query("SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = #{id}").rows.empty?
      end
    end
    refute_equal id, connection_id(db), "the first call after the kill succeeds, on a new connection"
  end

  def test_a_timeout_on_a_plain_thread_kills_the_query_on_the_server
    db = client
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    thread = Thread.new do
      Timeout.timeout(0.5) { db.query(sleep_sql(marker)) }
    rescue Timeout::Error => e
      e
    end
    watcher.value
    assert_kind_of Timeout::Error, thread.value
    assert_stops_on_the_server(marker)
    assert_equal 0, db.stats[:in_use]
  end

  private

  def client(size: 1, **options)
    track(NeverBlock::MySQL.pool(driver: driver, size: size, **mysql_config, **options))
  end

  # mysql2 reads the interrupted reply and keeps the session; trilogy has
  # closed its socket, so the pool has a new one. Either way it works.
  def assert_connection_after_interrupt(db, id)
    assert_equal 0, db.stats[:in_use]
    if driver == :mysql2
      assert_equal id, connection_id(db), "the same connection came back to the pool, and works"
    else
      refute_equal id, connection_id(db), "a new connection replaced the interrupted one, and works"
    end
  end

  # A query that would run for 30 s, findable in the process list by `marker`.
  def sleep_sql(marker)
    "SELECT SLEEP(30) /* #{marker} */"
  end

  # The id of the session running the query that contains `marker`, or nil.
  def running_id(admin, marker)
    admin.query(<<~SQL).rows.first&.first
      SELECT ID FROM information_schema.PROCESSLIST
      WHERE COMMAND = 'Query' AND INFO LIKE '%#{marker}%' AND ID <> CONNECTION_ID()
    SQL
  end

  # A task that finishes, with the session's id, once the server runs the
  # query marked `marker`.
  def watch_for(marker)
    NeverBlock.spawn { with_admin { |admin| wait_until("#{marker} to start") { running_id(admin, marker) } } }
  end

  def assert_stops_on_the_server(marker)
    with_admin { |admin| wait_until("#{marker} to stop on the server", seconds: 2) { running_id(admin, marker).nil? } }
  end

  def wait_until(what, seconds: 5)
    deadline = now + seconds
    loop do
      value = yield
      return value if value

      flunk "waited #{seconds} s for #{what}" if now > deadline
      sleep 0.01
    end
  end
end

class MySQLRecoveryTrilogyTest < NeverBlockTest
  include MySQLRecoveryTests

  def driver
    :trilogy
  end
end

class MySQLRecoveryMysql2Test < NeverBlockTest
  include MySQLRecoveryTests

  def driver
    :mysql2
  end
end
