# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "neverblock/postgres"

# NeverBlock::Postgres.pool and its Client inside the loop, against the
# PostgreSQL that bin/test starts: queries, transactions, the raw
# connection, SQL errors, concurrency, pool exhaustion, LISTEN/NOTIFY.
class PostgresClientTest < NeverBlockTest
  include NeverBlockTest::PostgresHelpers

  def test_exec_returns_the_result_of_the_sql
    db = client
    assert_equal [%w[1 two]], db.exec("SELECT 1, 'two'").values
  end

  def test_exec_params_sends_the_parameters_apart_from_the_sql
    db = client
    hostile = "'); DROP TABLE pg_class; --"
    assert_equal [[hostile, "42"]], db.exec_params("SELECT $1::text, $2::int", [hostile, 42]).values
  end

  def test_the_connection_can_be_given_as_a_url
    db = client_from(url: pg_url)
    assert_equal pg_conninfo[:dbname], db.exec("SELECT current_database()").getvalue(0, 0)
  end

  def test_keywords_override_the_url
    wrong = pg_url.sub(%r{/[^/]*\z}, "/no_such_database")
    db = client_from(url: wrong, dbname: pg_conninfo[:dbname])
    assert_equal pg_conninfo[:dbname], db.exec("SELECT current_database()").getvalue(0, 0)
  end

  def test_transaction_commits_when_the_block_returns
    db = client
    table = create_table(db)
    value = db.transaction do |conn|
      assert_kind_of PG::Connection, conn
      conn.exec("INSERT INTO #{table} VALUES (1)")
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
          conn.exec("INSERT INTO #{table} VALUES (1)")
          raise KeyError
        end
      end
      db.transaction { |conn| conn.exec("INSERT INTO #{table} VALUES (2)") }
    end
    assert_equal [2], rows_seen_by_another_session(table).map(&:to_i)
  end

  def test_transaction_rolls_back_and_reraises_when_the_block_raises
    db = client
    table = create_table(db)
    assert_raises(KeyError) do
      db.transaction do |conn|
        conn.exec("INSERT INTO #{table} VALUES (1)")
        raise KeyError
      end
    end
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_calls_on_the_client_inside_a_transaction_run_in_it
    db = client(size: 4)
    ids = db.transaction do
      2.times.map { db.exec("SELECT txid_current(), pg_backend_pid()").values.first }
    end
    assert_equal 1, ids.uniq.size, "both statements ran in the same transaction on one connection"
  end

  def test_a_nested_transaction_joins_the_outer_one
    db = client
    table = create_table(db)
    assert_raises(KeyError) do
      db.transaction do
        db.transaction { db.exec("INSERT INTO #{table} VALUES (1)") }
        raise KeyError
      end
    end
    assert_equal [], rows_seen_by_another_session(table), "the inner block did not commit on its own"
  end

  def test_a_rescued_sql_error_inside_a_transaction_raises_transaction_rolled_back
    db = client
    table = create_table(db)
    error = assert_raises(NeverBlock::Postgres::TransactionRolledBack) do
      db.transaction do |conn|
        conn.exec("INSERT INTO #{table} VALUES (1)")
        begin
          conn.exec("SELECT 1/0")
        rescue PG::DivisionByZero
          nil # swallowed: PostgreSQL can only roll back now
        end
      end
    end
    assert_kind_of NeverBlock::Error, error
    assert_match(/rolled back/, error.message)
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_with_lends_the_raw_pg_connection
    db = client
    db.with do |conn|
      assert_kind_of PG::Connection, conn
      conn.prepare("nb_double", "SELECT $1::int * 2")
      assert_equal "42", conn.exec_prepared("nb_double", [21]).getvalue(0, 0)
      assert_same conn, db.with { |inner| inner }, "with is re-entrant"
    end
  end

  def test_an_sql_error_raises_in_the_calling_fiber_only
    db = client(size: 3)
    outcomes = 6.times.map do |i|
      NeverBlock.spawn do
        i == 3 ? db.exec("SELECT 1/0") : db.exec_params("SELECT $1::int", [i]).getvalue(0, 0)
      rescue PG::Error => e
        e
      end
    end.map(&:value)
    assert_kind_of PG::DivisionByZero, outcomes.delete_at(3)
    assert_equal %w[0 1 2 4 5], outcomes
  end

  def test_after_an_sql_error_the_same_connection_is_reused
    db = client(size: 1)
    pid = backend_pid(db)
    assert_raises(PG::UndefinedTable) { db.exec("SELECT * FROM nb_no_such_table") }
    assert_equal pid, backend_pid(db)
    assert_equal PG::PQTRANS_IDLE, db.with(&:transaction_status)
  end

  def test_an_sql_error_in_a_transaction_rolls_it_back_and_the_connection_is_reused
    db = client(size: 1)
    table = create_table(db)
    pid = backend_pid(db)
    assert_raises(PG::UniqueViolation) do
      db.transaction do |conn|
        conn.exec("INSERT INTO #{table} VALUES (1)")
        conn.exec("INSERT INTO #{table} VALUES (1)")
      end
    end
    assert_equal pid, backend_pid(db), "the same connection, not in an aborted transaction"
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_a_transaction_left_open_inside_with_is_rolled_back_before_reuse
    db = client(size: 1)
    table = create_table(db)
    assert_raises(KeyError) do
      db.with do |conn|
        conn.exec("BEGIN")
        conn.exec("INSERT INTO #{table} VALUES (1)")
        raise KeyError
      end
    end
    assert_equal PG::PQTRANS_IDLE, db.with(&:transaction_status)
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_ten_concurrent_one_second_sleeps_through_a_pool_of_ten_take_about_a_second
    db = client(size: 10)
    time = elapsed do
      10.times.map { NeverBlock.spawn { db.exec("SELECT pg_sleep(1)") } }.each(&:value)
    end
    assert_operator time, :<, 3, "ten one-second queries ran one after another"
    assert_equal 10, db.stats[:idle]
  end

  def test_other_fibers_run_while_a_query_waits
    db = client
    ticks = 0
    ticker = NeverBlock.spawn { loop { sleep 0.01; ticks += 1 } }
    db.exec("SELECT pg_sleep(0.3)")
    ticker.cancel
    ticker.wait
    assert_operator ticks, :>=, 5, "the loop was blocked during the query"
  end

  def test_an_exhausted_pool_raises_pool_timeout
    db = client(size: 1, timeout: 0.1)
    holder = NeverBlock.spawn { db.exec("SELECT pg_sleep(0.5)") }
    error = assert_raises(NeverBlock::PoolTimeout) { db.exec("SELECT 1") }
    assert_match(/size: 1, in_use: 1/, error.message)
    holder.value
    assert_equal "1", db.exec("SELECT 1").getvalue(0, 0), "usable again once the holder is done"
  end

  def test_queries_waiting_for_the_pool_are_served_in_order_by_hand_over
    db = client(size: 1)
    pid = backend_pid(db)
    order = []
    waiters = nil
    db.with do
      # Each task runs at once until it waits for the pool: they queue in order.
      waiters = 5.times.map { |i| NeverBlock.spawn { order << [i, backend_pid(db)] } }
      assert_equal 5, db.stats[:waiting]
    end
    waiters.each(&:wait)
    assert_equal (0..4).map { |i| [i, pid] }, order
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
  end

  def test_a_query_cancelled_while_the_connection_is_handed_to_it_leaks_nothing
    db = client(size: 1)
    pid = backend_pid(db)
    cancelled = patient = nil
    db.with do
      cancelled = NeverBlock.spawn { db.exec("SELECT 'never' FROM pg_sleep(10)") }
      patient = NeverBlock.spawn { db.exec("SELECT 'served'").getvalue(0, 0) }
    end
    # The connection went to `cancelled` as the block returned (hand_over ran it at
    # once: its query is on the server and cannot answer before the cancel lands).
    cancelled.cancel
    assert_raises(NeverBlock::Cancelled) { cancelled.value }
    assert_equal "served", patient.value
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
    assert_equal pid, backend_pid(db), "the connection was passed on, not closed"
  end

  def test_a_query_timing_out_while_waiting_for_the_pool_leaks_nothing
    db = client(size: 1, timeout: 5)
    holder = NeverBlock.spawn { db.exec("SELECT pg_sleep(0.3)") }
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.05) { db.exec("SELECT 1") } }
    assert_equal 0, db.stats[:waiting]
    holder.value
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
    assert_equal "1", db.exec("SELECT 1").getvalue(0, 0)
  end

  def test_listen_yields_notifications_without_blocking_the_loop
    db = client
    channel = unique_name("chan")
    received = []
    listener = NeverBlock.spawn do
      db.listen(channel) do |payload, name|
        received << [payload, name]
        break :enough if received.size == 2
      end
    end
    wait_until_listening(channel)
    db.notify(channel, "one")
    db.exec_params("SELECT pg_notify($1, 'two')", [channel])
    assert_equal :enough, listener.value
    assert_equal [["one", channel], ["two", channel]], received
  end

  # A NOTIFY sent once `ready` was called always arrives: no polling of
  # pg_listening_channels, no sleep.
  def test_listen_calls_ready_once_the_listen_took_effect
    db = client
    channel = unique_name("chan")
    listening = Thread::Queue.new
    listener = NeverBlock.spawn do
      db.listen(channel, ready: -> { listening << true }) { |payload| break payload }
    end
    listening.pop
    db.notify(channel, "right after ready")
    assert_equal "right after ready", listener.value
  end

  def test_an_empty_notification_payload_is_an_empty_string
    db = client
    channel = unique_name("chan")
    listening = Thread::Queue.new
    listener = NeverBlock.spawn { db.listen(channel, ready: -> { listening << true }) { |payload| break payload } }
    listening.pop
    db.notify(channel)
    assert_equal "", listener.value
  end

  def test_listen_returns_nil_after_its_timeout_without_a_notification
    db = client
    assert_nil db.listen(unique_name("quiet"), timeout: 0.1) { flunk "nothing was notified" }
  end

  def test_cancelling_a_listening_task_closes_its_connection
    db = client
    channel = unique_name("chan")
    listener = NeverBlock.spawn { db.listen(channel) { flunk "nothing was notified" } }
    wait_until_listening(channel)
    listener.cancel
    assert_raises(NeverBlock::Cancelled) { listener.value }
    with_admin do |admin|
      wait_until("the listening session to end") { listening_pids(admin, channel).empty? }
    end
  end

  private

  def listening_pids(admin, channel)
    listen = "LISTEN #{PG::Connection.quote_ident(channel)}"
    admin.exec_params("SELECT pid FROM pg_stat_activity WHERE query = $1", [listen]).column_values(0)
  end

  # Waits until the server shows a session that has run LISTEN on `channel`
  # (notifications sent before that are not delivered to it).
  def wait_until_listening(channel)
    with_admin { |admin| wait_until("LISTEN #{channel}") { listening_pids(admin, channel).any? } }
  end

  def wait_until(what, seconds: 5)
    deadline = now + seconds
    until yield
      flunk "waited #{seconds} s for #{what}" if now > deadline
      sleep 0.01
    end
  end
end

# The same client from plain threads, with no event loop: it blocks the
# calling thread only, and forked children get connections of their own.
class PostgresClientThreadsTest < PlainTest
  include NeverBlockTest::Databases

  def setup
    @db = NeverBlock::Postgres.pool(size: 5, **pg_conninfo)
  end

  def teardown
    @db.close
  end

  def test_plain_threads_share_the_pool_and_wait_concurrently
    time = elapsed do
      5.times.map { Thread.new { @db.exec("SELECT pg_sleep(1)") } }.each(&:join)
    end
    assert_operator time, :<, 3, "five one-second queries from five threads ran one after another"
    assert_equal 5, @db.stats[:idle]
  end

  def test_fibers_and_plain_threads_share_one_client
    @db.close
    @db = NeverBlock::Postgres.pool(size: 2, **pg_conninfo) # closed in teardown
    loops = 2.times.map do |n|
      Thread.new do
        NeverBlock.run do
          10.times.map { |i| NeverBlock.spawn { 5.times.map { |j| query(n, i, j) } } }.flat_map(&:value)
        end
      end
    end
    threads = 2.times.map { |n| Thread.new { 20.times.map { |j| query(n + 2, 0, j) } } }
    results = (loops + threads).flat_map(&:value)
    assert_equal 140, results.size
    assert(results.all? { |sent, got| sent == got })
    assert_equal({ size: 2, in_use: 0, idle: 2, waiting: 0 }, @db.stats)
  end

  def test_a_transaction_from_a_plain_thread
    ids = Thread.new do
      @db.transaction { 2.times.map { @db.exec("SELECT txid_current()").getvalue(0, 0) } }
    end.value
    assert_equal 1, ids.uniq.size
  end

  def test_a_forked_child_gets_fresh_connections
    parent = backend_pid # an idle connection in the parent's pool
    child = in_child do
      [backend_pid, NeverBlock.run { backend_pid }].uniq.join(",")
    end
    refute_equal parent.to_s, child
    refute_includes child, ",", "the child reused its own connection"
  end

  def test_the_parents_idle_connection_survives_a_forked_childs_exit
    parent = backend_pid
    in_child { backend_pid } # the child opens its own, uses it and exits normally
    assert_equal parent, backend_pid, "the child's exit ended the parent's session, so the pool opened another"
  end

  private

  def backend_pid
    Integer(@db.exec("SELECT pg_backend_pid()").getvalue(0, 0))
  end

  # A short query that waits for the pool as often as not: [sent, got back].
  def query(*ids)
    sent = ids.join(".")
    [sent, @db.exec_params("SELECT $1::text, pg_sleep(0.001)", [sent]).getvalue(0, 0)]
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
