# frozen_string_literal: true

# What every pooled database client promises, whichever the database:
# queries, transactions, the raw connection, SQL errors, concurrency and pool
# exhaustion. Included by test/neverblock/postgres/client_test.rb and
# test/neverblock/mysql/client_test.rb (once per driver), as Sequel runs one
# integration suite against every adapter; what only one database does stays
# in that adapter's file.
#
# The including class provides (NeverBlockTest::PostgresHelpers and
# ::MySQLHelpers do):
#   client(**options)            a pool on the test database, closed in teardown
#   client_from(**options)       a pool with exactly these options, closed in teardown
#   execute(target, sql)         runs `sql` on a client or a raw connection
#   value(target, sql)           the first column of the first row, as a String
#   session_id(db)               the server's id for the session `db` lends (Integer)
#   in_transaction?(db)          whether the session `db` lends is inside a transaction
#   sql_error                    the driver's error class for an SQL error
#   raw_connection_class         the class #with lends
#   sleep_sql(seconds)           a query that runs that long on the server
#   database_url(database)       a URL of the test server naming `database`
#   database_option              the connection option that names the database
#   database_name                the test database's name
#   current_database_sql         a query that returns the session's database name
#   create_table(db)             a table `(id integer PRIMARY KEY)`, dropped in teardown
#   rows_seen_by_another_session(table)  its ids, read by a session outside the pool
#
# (Loaded by test_helper after the NeverBlockTest class is defined.)
module NeverBlockTest::DatabaseClientContract
  def test_the_connection_can_be_given_as_a_url
    db = client_from(url: database_url(database_name))
    assert_equal database_name, value(db, current_database_sql)
  end

  def test_keywords_override_the_url
    db = client_from(url: database_url("no_such_database"), database_option => database_name)
    assert_equal database_name, value(db, current_database_sql)
  end

  def test_transaction_commits_when_the_block_returns
    db = client
    table = create_table(db)
    returned = db.transaction do |conn|
      assert_kind_of raw_connection_class, conn
      execute(conn, "INSERT INTO #{table} VALUES (1)")
      :done
    end
    assert_equal :done, returned
    assert_equal [1], rows_seen_by_another_session(table)
  end

  def test_a_transaction_that_raises_inside_with_is_rolled_back_at_once
    db = client
    table = create_table(db)
    db.with do
      assert_raises(KeyError) do
        db.transaction do |conn|
          execute(conn, "INSERT INTO #{table} VALUES (1)")
          raise KeyError
        end
      end
      db.transaction { |conn| execute(conn, "INSERT INTO #{table} VALUES (2)") }
    end
    assert_equal [2], rows_seen_by_another_session(table)
  end

  def test_transaction_rolls_back_and_reraises_when_the_block_raises
    db = client
    table = create_table(db)
    assert_raises(KeyError) do
      db.transaction do |conn|
        execute(conn, "INSERT INTO #{table} VALUES (1)")
        raise KeyError
      end
    end
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_calls_on_the_client_inside_a_transaction_run_in_it
    db = client(size: 4)
    sessions = db.transaction do
      2.times.map do
        assert in_transaction?(db), "the call ran outside the transaction"
        session_id(db)
      end
    end
    assert_equal 1, sessions.uniq.size, "both statements ran on one connection"
  end

  def test_a_nested_transaction_joins_the_outer_one
    db = client
    table = create_table(db)
    assert_raises(KeyError) do
      db.transaction do
        db.transaction { execute(db, "INSERT INTO #{table} VALUES (1)") }
        raise KeyError
      end
    end
    assert_equal [], rows_seen_by_another_session(table), "the inner block did not commit on its own"
  end

  def test_with_lends_the_raw_connection_and_is_reentrant
    db = client
    db.with do |conn|
      assert_kind_of raw_connection_class, conn
      assert_same conn, db.with { |inner| inner }, "with is re-entrant"
      assert_equal "42", value(conn, "SELECT 42")
    end
    assert_equal({ in_use: 0, idle: 1, waiting: 0 }, db.stats.slice(:in_use, :idle, :waiting))
  end

  def test_an_sql_error_raises_in_the_calling_fiber_only
    db = client(size: 3)
    outcomes = 6.times.map do |i|
      NeverBlock.spawn do
        i == 3 ? execute(db, "SELECT * FROM nb_no_such_table") : value(db, "SELECT #{i}")
      rescue sql_error => e
        e
      end
    end.map(&:value)
    error = outcomes.delete_at(3)
    assert_kind_of sql_error, error
    assert_match(/nb_no_such_table/, error.message)
    assert_equal %w[0 1 2 4 5], outcomes
  end

  def test_after_an_sql_error_the_same_connection_is_reused
    db = client(size: 1)
    id = session_id(db)
    assert_raises(sql_error) { execute(db, "SELEC 1") }
    assert_equal id, session_id(db)
    refute in_transaction?(db)
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
  end

  def test_an_sql_error_in_a_transaction_rolls_it_back_and_the_connection_is_reused
    db = client(size: 1)
    table = create_table(db)
    id = session_id(db)
    error = assert_raises(sql_error) do
      db.transaction do |conn|
        execute(conn, "INSERT INTO #{table} VALUES (1)")
        execute(conn, "INSERT INTO #{table} VALUES (1)")
      end
    end
    assert_match(/duplicate/i, error.message)
    assert_equal id, session_id(db), "the same connection went back to the pool"
    refute in_transaction?(db), "no transaction left open on it"
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_a_transaction_left_open_inside_with_after_an_error_is_rolled_back_before_reuse
    db = client(size: 1)
    table = create_table(db)
    assert_raises(KeyError) do
      db.with do |conn|
        execute(conn, "BEGIN")
        execute(conn, "INSERT INTO #{table} VALUES (1)")
        raise KeyError
      end
    end
    refute in_transaction?(db)
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_ten_concurrent_one_second_sleeps_through_a_pool_of_ten_take_about_a_second
    db = client(size: 10)
    time = elapsed do
      10.times.map { NeverBlock.spawn { execute(db, sleep_sql(1)) } }.each(&:value)
    end
    assert_operator time, :<, 3, "ten one-second queries ran one after another"
    assert_equal 10, db.stats[:idle]
  end

  # The ticker's sleep is the work being measured, not an ordering.
  def test_other_fibers_run_while_a_query_waits
    db = client
    ticks = 0
    ticker = NeverBlock.spawn { loop { sleep 0.01; ticks += 1 } }
    execute(db, sleep_sql(0.3))
    ticker.cancel
    ticker.wait
    assert_operator ticks, :>=, 5, "the loop was blocked during the query"
  end

  def test_an_exhausted_pool_raises_pool_timeout
    db = client(size: 1, timeout: 0.1)
    holder = NeverBlock.spawn { execute(db, sleep_sql(0.5)) } # runs at once, until the server answers
    error = assert_raises(NeverBlock::PoolTimeout) { execute(db, "SELECT 1") }
    assert_match(/size: 1, in_use: 1/, error.message)
    holder.value
    assert_equal "1", value(db, "SELECT 1"), "usable again once the holder is done"
  end

  def test_a_query_timing_out_while_waiting_for_the_pool_leaks_nothing
    db = client(size: 1, timeout: 5)
    holder = NeverBlock.spawn { execute(db, sleep_sql(0.3)) }
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.05) { execute(db, "SELECT 1") } }
    assert_equal 0, db.stats[:waiting]
    holder.value
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
    assert_equal "1", value(db, "SELECT 1")
  end
end

# The same clients from plain threads, with no event loop: a query blocks
# the calling thread only, and forked children get connections of their
# own. Included by the PlainTest classes of the same two files; the hooks
# are those of NeverBlockTest::DatabaseClientContract.
module NeverBlockTest::DatabaseClientThreadsContract
  def setup
    super
    @db = client(size: 5)
  end

  def test_plain_threads_share_the_pool_and_wait_concurrently
    time = elapsed do
      5.times.map { Thread.new { execute(@db, sleep_sql(1)) } }.each(&:join)
    end
    assert_operator time, :<, 3, "five one-second queries from five threads ran one after another"
    assert_equal 5, @db.stats[:idle]
  end

  def test_a_transaction_from_a_plain_thread
    sessions = Thread.new do
      @db.transaction { 2.times.map { [session_id(@db), in_transaction?(@db)] } }
    end.value
    assert_equal [[sessions.first.first, true]], sessions.uniq
  end

  def test_a_forked_child_gets_fresh_connections
    parent = session_id(@db) # an idle connection in the parent's pool
    child = in_child { [session_id(@db), NeverBlock.run { session_id(@db) }].uniq.join(",") }
    refute_equal parent.to_s, child
    refute_includes child, ",", "the child reused its own connection"
  end

  def test_the_parents_idle_connection_survives_a_forked_childs_exit
    parent = session_id(@db)
    in_child { session_id(@db) } # the child opens its own, uses it and exits normally
    assert_equal parent, session_id(@db), "the child's exit ended the parent's session, so the pool opened another"
  end

  private

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
