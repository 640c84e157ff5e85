# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "trilogy"
require "mysql2"
require "neverblock/mysql"

# What happens to a query and its pooled connection when the caller gives up
# half-way or the server ends the session (NeverBlockTest::DatabaseRecoveryContract),
# on MariaDB: the query stops on the server (KILL QUERY), and the pool goes on
# with a clean connection — the same one with mysql2, a new one with trilogy,
# which closes its socket when interrupted. information_schema.PROCESSLIST
# shows it from the server's side. Here also: the driver's own read timeout,
# and a timeout during a query on the raw connection.
module MySQLRecoveryTests
  include NeverBlockTest::MySQLHelpers
  include NeverBlockTest::DatabaseRecoveryContract

  def test_the_drivers_read_timeout_kills_the_query_on_the_server
    db = client(read_timeout: 1)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    error = assert_raises(driver_error) { db.query(long_sql(marker)) }
    assert_match(/timeout|timed out/i, "#{error.class} #{error.message}")
    watcher.value
    assert_stops_on_the_server(marker)
    assert_equal [[1]], rows(db.query("SELECT 1"))
  end

  def test_a_timeout_during_a_query_on_the_raw_connection_kills_it_on_the_server
    if driver == :mysql2 && RUBY_VERSION < "3.2"
      skip "open bug: on Ruby 3.1 in the full suite, reopening the replaced mysql2 connection (connect on the thread pool) " \
           "sometimes never returns (2 of 3 full runs, not reproduced alone)"
    end
    db = client
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.5) { db.with { |conn| conn.query(long_sql(marker)) } }
    end
    watcher.value
    assert_stops_on_the_server(marker)
    assert_equal({ size: 1, in_use: 0, idle: 0, waiting: 0 }, db.stats, "the driver closed its socket: replaced")
    assert_equal [[1]], rows(db.query("SELECT 1"))
  end

  private

  def client(size: 1, **options)
    super
  end

  # The id of the session running the query that contains `marker`, or nil.
  def running_session(admin, marker)
    admin.query(<<~SQL).rows.first&.first
      SELECT ID FROM information_schema.PROCESSLIST
      WHERE COMMAND = 'Query' AND INFO LIKE '%#{marker}%' AND ID <> CONNECTION_ID()
    SQL
  end

  def kill_session(admin, id)
    admin.query("KILL #{Integer(id)}")
  end

  def session_exists?(admin, id)
    admin.query("SELECT 1 FROM information_schema.PROCESSLIST WHERE ID = #{Integer(id)}").rows.any?
  end

  # KILL QUERY stops SLEEP at once; the timeouts nested 0.1 s apart still
  # arrive while the pool kills and reads the interrupted reply.
  def stubborn_sql(_db)
    sleep_sql(30)
  end

  # The pool checks every connection before lending it.
  def wait_for_health_check; end

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

  # Inside a transaction mysql2 may replace its session too (seen in one run of two).
  def assert_connection_after_interrupted_transaction(db, _id)
    assert_equal 0, db.stats[:in_use]
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
