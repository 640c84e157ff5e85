# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "neverblock/postgres"

# NeverBlock::Postgres.pool and its Client inside the loop, against the
# PostgreSQL that bin/test starts. What every database client does
# (queries, transactions, the raw connection, SQL errors, concurrency, pool
# exhaustion) is NeverBlockTest::DatabaseClientContract; here are exec and
# exec_params, PostgreSQL's aborted transactions, prepared statements, a
# cancel during a hand-over, and LISTEN/NOTIFY.
class PostgresClientTest < NeverBlockTest
  include NeverBlockTest::PostgresHelpers
  include NeverBlockTest::DatabaseClientContract

  def test_exec_returns_the_result_of_the_sql
    db = client
    assert_equal [%w[1 two]], db.exec("SELECT 1, 'two'").values
  end

  def test_exec_params_sends_the_parameters_apart_from_the_sql
    db = client
    hostile = "'); DROP TABLE pg_class; --"
    assert_equal [[hostile, "42"]], db.exec_params("SELECT $1::text, $2::int", [hostile, 42]).values
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

  def test_the_raw_connection_runs_prepared_statements
    db = client
    db.with do |conn|
      conn.prepare("nb_double", "SELECT $1::int * 2")
      assert_equal "42", conn.exec_prepared("nb_double", [21]).getvalue(0, 0)
    end
  end

  # (Not in the contract: with trilogy, the waiters were sometimes served
  # last-first, 1 run in 2 on 2026-11-23.)
  def test_queries_waiting_for_the_pool_are_served_in_order
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
    # The connection went to `cancelled` as the block returned, and this
    # fiber's wait runs it in its place (Scheduler#wake_next): its query is
    # on its way to the server. The cancel is sent once the server runs it:
    # PostgreSQL drops a cancel that lands before its backend has read the
    # query, and the query would then run its 10 s (on a loaded machine,
    # 1 run in about 6 passes of the suite).
    sleep 0
    with_admin do |admin|
      wait_until("the query to run on the server") do
        admin.exec_params("SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active' AND query = $2",
                          [pid, "SELECT 'never' FROM pg_sleep(10)"]).ntuples == 1
      end
    end
    cancelled.cancel
    assert_raises(NeverBlock::Cancelled) { cancelled.value }
    assert_equal "served", patient.value
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
    assert_equal pid, backend_pid(db), "the connection was passed on, not closed"
  end

  # PostgreSQL drops a cancel that reaches the backend before it has read
  # the query (it cancels only a statement running). Played with the
  # backend stopped (SIGSTOP) while the query and the cancel reach it:
  # continued, it takes the cancel first, while it waits for a command
  # (dropped), then runs the query. The cancel, sent again while no result
  # comes (Recovery::CANCEL_AGAIN), ends it: the connection is back within
  # about a second, not closed after RECOVERY_TIMEOUT (5 s).
  def test_a_cancel_that_lands_before_the_query_runs_is_sent_again
    db = client(size: 1)
    pid = signallable_backend(db)
    query = with_backend_stopped(pid) { cancelled_query(db) }
    took = elapsed { assert_raises(NeverBlock::Cancelled) { query.value } }
    assert_operator took, :<, 3, "the cancel was not sent again"
    assert_equal pid, backend_pid(db), "the connection was closed, not passed on"
  end

  # The recovery of an interrupted query gives its connection up (here the
  # backend ends, SIGTERM, as pg_terminate_backend does): the query raises
  # its interrupt, not the check-in's PG::ConnectionBad, and the pool opens
  # another connection.
  def test_a_query_whose_recovery_gives_the_connection_up_raises_its_interrupt
    db = client(size: 1)
    pid = signallable_backend(db)
    query = with_backend_stopped(pid) do
      cancelled_query(db).tap { Process.kill(:TERM, pid) }
    end
    assert_raises(NeverBlock::Cancelled) { query.value }
    refute_equal pid, backend_pid(db)
  end

  # @return [Integer] the pid of `db`'s backend, when this process may stop
  #   it (root, and the server runs here: not NEVERBLOCK_DATABASES=external)
  def signallable_backend(db)
    skip "needs to signal the server's backend (root)" unless Process.uid.zero?
    pid = backend_pid(db)
    comm = File.read("/proc/#{pid}/comm").strip rescue nil # rubocop:disable Style/RescueModifier -- not here
    skip "the backend (pid #{pid}) is not a process of this machine's" unless comm&.start_with?("postgres")
    pid
  end

  # Runs the block with the backend stopped (SIGSTOP), continued after it.
  def with_backend_stopped(pid)
    Process.kill(:STOP, pid)
    yield
  ensure
    Process.kill(:CONT, pid)
  end

  # A task whose query is in the (stopped) backend's socket, cancelled: the
  # cancel reaches the backend before it reads the query.
  # @return [NeverBlock::Task]
  def cancelled_query(db)
    query = NeverBlock.spawn { db.exec("SELECT 'never' FROM pg_sleep(10)") }
    sleep 0.2 # the query is in the backend's socket
    query.cancel
    sleep 0.3 # the cancel is sent: the postmaster signalled the stopped backend
    query
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

  def wait_until(what, seconds: 30)
    deadline = now + seconds
    until yield
      flunk "waited #{seconds} s for #{what}" if now > deadline
      sleep 0.01
    end
  end
end

# The same client from plain threads, with no event loop
# (NeverBlockTest::DatabaseClientThreadsContract), and shared by fibers and
# threads at once.
class PostgresClientThreadsTest < PlainTest
  include NeverBlockTest::PostgresHelpers
  include NeverBlockTest::DatabaseClientThreadsContract

  def test_fibers_and_plain_threads_share_one_client
    @db = client(size: 2)
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

  private

  # A short query that waits for the pool as often as not: [sent, got back].
  def query(*ids)
    sent = ids.join(".")
    [sent, @db.exec_params("SELECT $1::text, pg_sleep(0.001)", [sent]).getvalue(0, 0)]
  end
end
