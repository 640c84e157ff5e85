# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "trilogy"
require "mysql2"
require "neverblock/mysql"

# NeverBlock::MySQL.pool and its Client inside the loop, against the MariaDB
# that bin/test starts. What every database client does (queries,
# transactions, the raw connection, SQL errors, concurrency, pool
# exhaustion) is NeverBlockTest::DatabaseClientContract; here are the
# drivers' results, isolation levels, a transaction left open by a block that
# returns, and unread multi-statement results. Every test runs once per
# driver (the classes at the end of the file).
module MySQLClientTests
  include NeverBlockTest::MySQLHelpers
  include NeverBlockTest::DatabaseClientContract

  def test_query_returns_the_drivers_result
    db = client
    assert_equal [[1, "two"]], rows(db.query("SELECT 1, 'two'"))
    assert_kind_of driver == :trilogy ? Trilogy::Result : Mysql2::Result, db.query("SELECT 1")
    assert_equal driver, db.driver
  end

  def test_two_fibers_transactions_are_isolated_until_commit
    db = client(size: 2)
    table = create_table(db)
    inserted = Thread::Queue.new
    looked = Thread::Queue.new
    writer = NeverBlock.spawn do
      db.transaction do
        db.query("INSERT INTO #{table} VALUES (1)")
        inserted << true
        looked.pop
      end
    end
    reader = NeverBlock.spawn do
      db.transaction(isolation: :read_committed) do
        inserted.pop
        before = rows(db.query("SELECT id FROM #{table}"))
        looked << true
        writer.wait
        [before, rows(db.query("SELECT id FROM #{table}"))]
      end
    end
    before, after = reader.value
    assert_equal [], before, "the uncommitted row was visible to the other transaction"
    assert_equal [[1]], after, "the committed row is visible (read committed)"
  end

  def test_transaction_takes_isolation_and_read_only
    db = client
    levels = db.transaction(isolation: :serializable, read_only: true) do
      rows(db.query("SELECT @@in_transaction"))
    end
    assert_equal [[1]], levels
    table = create_table(db)
    assert_raises(driver_error) do
      db.transaction(read_only: true) { db.query("INSERT INTO #{table} VALUES (1)") }
    end
    assert_raises(ArgumentError) { db.transaction(isolation: :chaotic) { flunk "ran" } }
  end

  def test_a_transaction_left_open_by_a_with_block_that_returns_is_rolled_back_with_a_warning
    db = client(size: 1)
    table = create_table(db)
    log = capture_log do
      db.with do |conn|
        conn.query("START TRANSACTION")
        conn.query("INSERT INTO #{table} VALUES (1)")
      end
    end
    assert_match(/a transaction was left open on a pooled MySQL connection; rolled back/, log)
    assert_equal [[0]], rows(db.query("SELECT @@in_transaction"))
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_results_a_multi_statement_query_left_unread_are_dropped_before_reuse
    db = client(size: 1, **multi_statements)
    id = connection_id(db)
    db.with { |conn| conn.query("SELECT 1; SELECT 2; SELECT 3") } # reads only the first
    assert_equal [[4]], rows(db.query("SELECT 4"))
    assert_equal id, connection_id(db)
  end

  private

  # The driver's option that lets one query hold several statements.
  def multi_statements
    driver == :trilogy ? { multi_statement: true } : { flags: Mysql2::Client::MULTI_STATEMENTS }
  end
end

class MySQLClientTrilogyTest < NeverBlockTest
  include MySQLClientTests

  def driver
    :trilogy
  end
end

class MySQLClientMysql2Test < NeverBlockTest
  include MySQLClientTests

  def driver
    :mysql2
  end
end

# The same client from plain threads, with no event loop
# (NeverBlockTest::DatabaseClientThreadsContract), once per driver.
module MySQLClientThreadsTests
  include NeverBlockTest::MySQLHelpers
  include NeverBlockTest::DatabaseClientThreadsContract

  def test_an_sql_error_on_a_plain_thread_leaves_the_connection_usable
    Thread.new do
      assert_raises(driver_error) { @db.query("SELEC 1") }
      assert_equal 1, @db.query("SELECT 1").to_a.size
    end.join
    assert_equal 1, @db.stats[:idle]
  end
end

class MySQLClientThreadsTrilogyTest < PlainTest
  include MySQLClientThreadsTests

  def driver
    :trilogy
  end
end

class MySQLClientThreadsMysql2Test < PlainTest
  include MySQLClientThreadsTests

  def driver
    :mysql2
  end
end
