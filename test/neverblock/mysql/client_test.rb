# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "trilogy"
require "mysql2"
require "neverblock/mysql"

# NeverBlock::MySQL.pool and its Client inside the loop, against the MariaDB
# that bin/test starts: queries, concurrency, SQL errors, transactions, the
# raw connection, pool exhaustion. Every test runs once per driver (the
# classes at the end of the file).
module MySQLClientTests
  include NeverBlockTest::MySQLHelpers

  def test_query_returns_the_drivers_result
    db = client
    assert_equal [[1, "two"]], rows(db.query("SELECT 1, 'two'"))
    assert_kind_of driver == :trilogy ? Trilogy::Result : Mysql2::Result, db.query("SELECT 1")
    assert_equal driver, db.driver
  end

  def test_the_connection_can_be_given_as_a_url
    config = mysql_config
    url = "mysql://#{config[:username]}:#{config[:password]}@#{config[:host]}:#{config[:port]}/#{config[:database]}"
    db = track(NeverBlock::MySQL.pool(driver: driver, url: url))
    assert_equal [[config[:database]]], rows(db.query("SELECT DATABASE()"))
  end

  def test_keywords_override_the_url
    config = mysql_config
    url = "mysql://#{config[:username]}:#{config[:password]}@#{config[:host]}:#{config[:port]}/no_such_database"
    db = track(NeverBlock::MySQL.pool(driver: driver, url: url, database: config[:database]))
    assert_equal [[config[:database]]], rows(db.query("SELECT DATABASE()"))
  end

  def test_ten_concurrent_one_second_sleeps_through_a_pool_of_ten_take_about_a_second
    db = client(size: 10)
    time = elapsed do
      10.times.map { NeverBlock.spawn { db.query("SELECT SLEEP(1)") } }.each(&:value)
    end
    assert_operator time, :<, 3, "ten one-second queries ran one after another"
    assert_equal 10, db.stats[:idle]
  end

  def test_other_fibers_run_while_a_query_waits
    db = client
    ticks = 0
    ticker = NeverBlock.spawn { loop { sleep 0.01; ticks += 1 } }
    db.query("SELECT SLEEP(0.3)")
    ticker.cancel
    ticker.wait
    assert_operator ticks, :>=, 5, "the loop was blocked during the query"
  end

  def test_an_sql_error_raises_in_the_calling_fiber_only
    db = client(size: 3)
    outcomes = 6.times.map do |i|
      NeverBlock.spawn do
        i == 3 ? db.query("SELECT * FROM nb_no_such_table") : rows(db.query("SELECT #{i}")).first.first
      rescue driver_error => e
        e
      end
    end.map(&:value)
    assert_match(/nb_no_such_table' doesn't exist/, outcomes.delete_at(3).message)
    assert_equal [0, 1, 2, 4, 5], outcomes
  end

  def test_after_an_sql_error_the_same_connection_is_reused
    db = client(size: 1)
    id = connection_id(db)
    assert_raises(driver_error) { db.query("SELEC 1") }
    assert_equal id, connection_id(db)
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
  end

  def test_transaction_commits_when_the_block_returns
    db = client
    table = create_table(db)
    value = db.transaction do |conn|
      assert_kind_of driver == :trilogy ? Trilogy : Mysql2::Client, conn
      conn.query("INSERT INTO #{table} VALUES (1)")
      :done
    end
    assert_equal :done, value
    assert_equal [1], rows_seen_by_another_session(table)
  end

  def test_a_transaction_that_raises_inside_with_is_rolled_back_at_once
    db = client
    table = create_table(db)
    db.with do
      assert_raises(KeyError) do
        db.transaction do |conn|
          conn.query("INSERT INTO #{table} VALUES (1)")
          raise KeyError
        end
      end
      db.transaction { |conn| conn.query("INSERT INTO #{table} VALUES (2)") }
    end
    assert_equal [2], rows_seen_by_another_session(table).map(&:to_i)
  end

  def test_transaction_rolls_back_and_reraises_when_the_block_raises
    db = client
    table = create_table(db)
    assert_raises(KeyError) do
      db.transaction do |conn|
        conn.query("INSERT INTO #{table} VALUES (1)")
        raise KeyError
      end
    end
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_an_sql_error_in_a_transaction_rolls_it_back_and_the_connection_is_reused
    db = client(size: 1)
    table = create_table(db)
    id = connection_id(db)
    assert_raises(driver_error) do
      db.transaction do
        db.query("INSERT INTO #{table} VALUES (1)")
        db.query("INSERT INTO #{table} VALUES (1)") # duplicate key
      end
    end
    assert_equal id, connection_id(db), "the same connection went back to the pool"
    assert_equal [], rows_seen_by_another_session(table)
    assert_equal [[0]], rows(db.query("SELECT @@in_transaction")), "no transaction left open on it"
  end

  def test_calls_on_the_client_inside_a_transaction_run_in_it
    db = client(size: 4)
    ids = db.transaction do
      2.times.map { rows(db.query("SELECT CONNECTION_ID(), @@in_transaction")).first }
    end
    assert_equal 1, ids.uniq.size, "both statements ran on one connection"
    assert_equal 1, ids.first.last, "inside the transaction"
  end

  def test_a_nested_transaction_joins_the_outer_one
    db = client
    table = create_table(db)
    assert_raises(KeyError) do
      db.transaction do
        db.transaction { db.query("INSERT INTO #{table} VALUES (1)") }
        raise KeyError
      end
    end
    assert_equal [], rows_seen_by_another_session(table), "the inner block did not commit on its own"
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

  def test_with_lends_the_raw_driver_connection_and_is_reentrant
    db = client
    db.with do |conn|
      assert_kind_of driver == :trilogy ? Trilogy : Mysql2::Client, conn
      assert_same conn, db.with { |inner| inner }, "with is re-entrant"
      assert_equal [[42]], rows(conn.query("SELECT 42"))
    end
    assert_equal({ size: 12, in_use: 0, idle: 1, waiting: 0 }, db.stats)
  end

  def test_a_transaction_left_open_inside_with_after_an_error_is_rolled_back
    db = client(size: 1)
    table = create_table(db)
    assert_raises(KeyError) do
      db.with do |conn|
        conn.query("BEGIN")
        conn.query("INSERT INTO #{table} VALUES (1)")
        raise KeyError
      end
    end
    assert_equal [[0]], rows(db.query("SELECT @@in_transaction"))
    assert_equal [], rows_seen_by_another_session(table)
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

  def test_an_exhausted_pool_raises_pool_timeout
    db = client(size: 1, timeout: 0.1)
    holder = NeverBlock.spawn { db.query("SELECT SLEEP(0.5)") }
    error = assert_raises(NeverBlock::PoolTimeout) { db.query("SELECT 1") }
    assert_match(/size: 1, in_use: 1/, error.message)
    holder.value
    assert_equal [[1]], rows(db.query("SELECT 1")), "usable again once the holder is done"
  end

  private

  def client(**options)
    track(NeverBlock::MySQL.pool(driver: driver, **mysql_config, **options))
  end

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

# The same client from plain threads, with no event loop: it blocks the
# calling thread only.
module MySQLClientThreadsTests
  include NeverBlockTest::Databases

  def setup
    @db = NeverBlock::MySQL.pool(driver: driver, size: 5, **mysql_config)
  end

  def teardown
    @db.close
  end

  def test_plain_threads_share_the_pool_and_wait_concurrently
    time = elapsed do
      5.times.map { Thread.new { @db.query("SELECT SLEEP(1)") } }.each(&:join)
    end
    assert_operator time, :<, 3, "five one-second queries from five threads ran one after another"
    assert_equal 5, @db.stats[:idle]
  end

  def test_a_transaction_from_a_plain_thread
    ids = Thread.new do
      @db.transaction { 2.times.map { @db.query("SELECT CONNECTION_ID(), @@in_transaction").to_a } }
    end.value
    assert_equal 1, ids.uniq.size
  end

  def test_an_sql_error_on_a_plain_thread_leaves_the_connection_usable
    Thread.new do
      assert_raises(StandardError) { @db.query("SELEC 1") }
      assert_equal 1, @db.query("SELECT 1").to_a.size
    end.join
    assert_equal 1, @db.stats[:idle]
  end

  def test_a_forked_child_gets_fresh_connections
    parent = connection_id # an idle connection in the parent's pool
    child = in_child { [connection_id, NeverBlock.run { connection_id }].uniq.join(",") }
    refute_equal parent.to_s, child
    refute_includes child, ",", "the child reused its own connection"
  end

  def test_the_parents_idle_connection_survives_a_forked_childs_exit
    parent = connection_id
    in_child { connection_id } # the child opens its own, uses it and exits normally
    assert_equal parent, connection_id, "the child's exit ended the parent's session, so the pool opened another"
  end

  private

  def connection_id
    result = @db.query("SELECT CONNECTION_ID()")
    result.respond_to?(:rows) ? result.rows.first.first : result.first.values.first
  end

  # Runs the block in a forked child that then exits normally (at_exit
  # handlers and finalizers run, as in a real worker); returns its value as a String.
  def in_child
    reader, writer = IO.pipe
    pid = fork do
      reader.close
      writer.write(yield.to_s)
      writer.close
    end
    writer.close
    _, status = Process.wait2(pid)
    assert status.success?, "the child failed"
    reader.read
  ensure
    reader&.close
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
