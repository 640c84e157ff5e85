# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "neverblock/postgres"

# What happens to a query and its pooled connection when the caller gives up
# half-way (a timeout, a cancellation) or the server ends the session: the
# query stops on the server, and the pool goes on with a clean connection.
# A second session watches pg_stat_activity to see it from the server's side.
class PostgresRecoveryTest < NeverBlockTest
  include NeverBlockTest::PostgresHelpers

  def test_a_neverblock_timeout_cancels_the_query_on_the_server_and_the_connection_is_reused
    db = client
    pid = backend_pid(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.5) { db.exec(sleep_sql(marker)) } }
    watcher.value # the query did run on the server
    assert_stops_on_the_server(marker)
    assert_equal pid, backend_pid(db), "the same connection came back to the pool, and works"
  end

  def test_a_stdlib_timeout_cancels_the_query_on_the_server
    db = client
    pid = backend_pid(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(Timeout::Error) { Timeout.timeout(0.5) { db.exec_params(sleep_sql(marker), []) } }
    watcher.value
    assert_stops_on_the_server(marker)
    assert_equal pid, backend_pid(db)
  end

  def test_cancelling_a_task_cancels_its_query_on_the_server
    db = client
    pid = backend_pid(db)
    marker = unique_name("sleep")
    task = NeverBlock.spawn { db.exec(sleep_sql(marker)) }
    watch_for(marker).value
    task.cancel
    assert_raises(NeverBlock::Cancelled) { task.value }
    assert_stops_on_the_server(marker)
    assert_equal pid, backend_pid(db)
  end

  def test_a_timeout_inside_a_transaction_rolls_it_back_on_the_same_connection
    db = client
    table = create_table(db)
    pid = backend_pid(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.5) do
        db.transaction do |conn|
          conn.exec("INSERT INTO #{table} VALUES (1)")
          conn.exec(sleep_sql(marker))
        end
      end
    end
    watcher.value
    assert_stops_on_the_server(marker)
    assert_equal pid, backend_pid(db)
    assert_equal PG::PQTRANS_IDLE, db.with(&:transaction_status)
    assert_equal "0", with_admin { |admin| admin.exec("SELECT count(*) FROM #{table}").getvalue(0, 0) }
  end

  def test_a_connection_goes_back_to_the_pool_even_when_interrupts_keep_arriving_during_recovery
    db = client
    # A statement that ignores cancel requests for 1.5 s, so that recovery
    # (cancel, then wait for the server) is still going on when the outer
    # timeouts fire.
    db.exec(<<~SQL)
      CREATE FUNCTION pg_temp.nb_stubborn_sleep() RETURNS void LANGUAGE plpgsql AS $$
      DECLARE deadline timestamptz := clock_timestamp() + interval '1.5 seconds';
      BEGIN
        WHILE clock_timestamp() < deadline LOOP
          BEGIN
            PERFORM pg_sleep(0.02);
          EXCEPTION WHEN query_canceled THEN
            NULL;
          END;
        END LOOP;
      END $$
    SQL
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.6) do
        NeverBlock.timeout(0.4) { NeverBlock.timeout(0.2) { db.exec("SELECT pg_temp.nb_stubborn_sleep()") } }
      end
    end
    # Closed or clean, the connection must not stay checked out by nobody.
    assert_equal 0, db.stats[:in_use]
    assert_equal "1", db.exec("SELECT 1").getvalue(0, 0)
  end

  def test_terminating_a_busy_backend_fails_that_call_and_the_next_call_gets_a_fresh_connection
    db = client
    marker = unique_name("sleep")
    busy = NeverBlock.spawn do
      db.exec(sleep_sql(marker))
    rescue PG::Error => e
      e
    end
    with_admin do |admin|
      pid = wait_until("the query to start") { running_pid(admin, marker) }
      admin.exec_params("SELECT pg_terminate_backend($1)", [pid])
      assert_kind_of PG::Error, busy.value
      refute_equal pid, backend_pid(db)
    end
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
  end

  def test_a_backend_terminated_while_idle_is_replaced_before_the_next_call
    db = client
    pid = backend_pid(db)
    with_admin do |admin|
      admin.exec_params("SELECT pg_terminate_backend($1)", [pid])
      wait_until("the session to end") do
        admin.exec_params("SELECT 1 FROM pg_stat_activity WHERE pid = $1", [pid]).ntuples.zero?
      end
    end
    # A connection is checked before it is lent once it has been back in
    # the pool this long (one back for less was just used).
    sleep NeverBlock::Postgres::Client::HEALTH_CHECK_AFTER
    refute_equal pid, backend_pid(db), "the first call after the termination succeeds, on a new connection"
  end

  private

  def client(size: 1, **options)
    client_from(size: size, **pg_conninfo, **options)
  end

  # A query that would run for 30 s, findable in pg_stat_activity by `marker`.
  def sleep_sql(marker)
    "SELECT pg_sleep(30) /* #{marker} */"
  end

  # The pid of the session running the query that contains `marker`, or nil.
  def running_pid(admin, marker)
    pid = admin.exec_params(<<~SQL, ["%#{marker}%"]).getvalue(0, 0)
      SELECT max(pid) FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1 AND pid <> pg_backend_pid()
    SQL
    pid && Integer(pid)
  end

  # A task that finishes once the server runs the query marked `marker`.
  def watch_for(marker)
    NeverBlock.spawn { with_admin { |admin| wait_until("#{marker} to start") { running_pid(admin, marker) } } }
  end

  def assert_stops_on_the_server(marker)
    with_admin { |admin| wait_until("#{marker} to stop on the server", seconds: 2) { running_pid(admin, marker).nil? } }
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

# A timeout on a plain thread (no event loop) interrupts a blocking query:
# it is cancelled on the server too.
class PostgresRecoveryThreadsTest < PlainTest
  include NeverBlockTest::Databases

  def test_a_timeout_on_a_plain_thread_cancels_the_query_on_the_server
    db = NeverBlock::Postgres.pool(size: 1, **pg_conninfo)
    pid = db.exec("SELECT pg_backend_pid()").getvalue(0, 0)
    marker = "nb_sleep_#{SecureRandom.hex(6)}"
    assert_raises(Timeout::Error) { Timeout.timeout(0.3) { db.exec("SELECT pg_sleep(30) /* #{marker} */") } }
    admin = PG.connect(**pg_conninfo)
    deadline = now + 2
    sql = "SELECT 1 FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1 AND pid <> pg_backend_pid()"
    sleep 0.01 while admin.exec_params(sql, ["%#{marker}%"]).ntuples.positive? && now < deadline
    assert_equal 0, admin.exec_params(sql, ["%#{marker}%"]).ntuples, "the query still runs on the server"
    assert_equal pid, db.exec("SELECT pg_backend_pid()").getvalue(0, 0)
  ensure
    admin&.close
    db&.close
  end
end
