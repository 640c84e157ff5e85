# frozen_string_literal: true

# What happens to a query and its pooled connection, whichever the database,
# when the caller gives up half-way (a timeout, a cancellation) or the server
# ends the session: the query stops on the server, and the pool goes on with
# a clean connection. A second session watches the server's list of sessions
# to see it from the server's side. Included by
# test/neverblock/postgres/recovery_test.rb and
# test/neverblock/mysql/recovery_test.rb (once per driver).
#
# The including class provides the hooks of
# NeverBlockTest::DatabaseClientContract (client, execute, value, session_id,
# in_transaction?, sql_error, sleep_sql, create_table,
# rows_seen_by_another_session; `client` opens one connection unless told
# otherwise), `with_admin` (a session outside the pool), and:
#   running_session(admin, marker)   the id of the session running the query that contains `marker`, or nil
#   kill_session(admin, id)          ends that session from the server's side
#   session_exists?(admin, id)
#   stubborn_sql(db)                 a statement that keeps running for a while after it is told to stop
#   wait_for_health_check            waits until the pool checks an idle connection before lending it
#   assert_connection_after_interrupt(db, id)  what the pool lends after the query on session `id` was interrupted
#   assert_connection_after_interrupted_transaction(db, id)  the same, for a query inside a transaction
#
# (Loaded by test_helper after the NeverBlockTest class is defined.)
module NeverBlockTest::DatabaseRecoveryContract
  # Seconds a query that would run 30 s runs before a test's timeout stops
  # it: long enough for the watcher to see it running on a loaded machine
  # (it polls every 10 ms; a 0.5 s window could pass in one pause).
  QUERY_TIMEOUT = 2

  def test_a_neverblock_timeout_stops_the_query_on_the_server
    db = client
    id = session_id(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(QUERY_TIMEOUT) { execute(db, long_sql(marker)) } }
    assert_equal id, watcher.value, "the query did run on the server, in the pooled session"
    assert_stops_on_the_server(marker)
    assert_equal 1, db.pool.cancels, "counted for the metrics (neverblock_db_pool_query_cancels_total)"
    assert_connection_after_interrupt(db, id)
  end

  def test_a_stdlib_timeout_stops_the_query_on_the_server
    db = client
    id = session_id(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(Timeout::Error) { Timeout.timeout(QUERY_TIMEOUT) { execute(db, long_sql(marker)) } }
    watcher.value
    assert_stops_on_the_server(marker)
    assert_connection_after_interrupt(db, id)
  end

  def test_cancelling_a_task_stops_its_query_on_the_server
    db = client
    id = session_id(db)
    marker = unique_name("sleep")
    task = NeverBlock.spawn { execute(db, long_sql(marker)) }
    watch_for(marker).value
    task.cancel
    assert_raises(NeverBlock::Cancelled) { task.value }
    assert_stops_on_the_server(marker)
    assert_equal 1, db.pool.cancels
    assert_connection_after_interrupt(db, id)
  end

  def test_a_timeout_inside_a_transaction_rolls_it_back
    db = client
    table = create_table(db)
    id = session_id(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(QUERY_TIMEOUT) do
        db.transaction do |conn|
          execute(conn, "INSERT INTO #{table} VALUES (1)")
          execute(conn, long_sql(marker))
        end
      end
    end
    watcher.value
    assert_stops_on_the_server(marker)
    assert_connection_after_interrupted_transaction(db, id)
    refute in_transaction?(db)
    assert_equal [], rows_seen_by_another_session(table)
  end

  def test_a_connection_goes_back_to_the_pool_even_when_interrupts_keep_arriving_during_recovery
    db = client
    sql = stubborn_sql(db)
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.3) do
        NeverBlock.timeout(0.2) { NeverBlock.timeout(0.1) { execute(db, sql) } }
      end
    end
    assert_equal 0, db.stats[:in_use], "closed or clean, the connection must not stay checked out by nobody"
    assert_equal "1", value(db, "SELECT 1")
  end

  def test_a_session_ended_by_the_server_while_busy_fails_that_call_and_the_next_call_gets_a_fresh_connection
    db = client
    marker = unique_name("sleep")
    busy = NeverBlock.spawn do
      execute(db, long_sql(marker))
    rescue sql_error => e
      e
    end
    id = watch_for(marker).value
    with_admin { |admin| kill_session(admin, id) }
    assert_kind_of sql_error, busy.value
    refute_equal id, session_id(db)
    assert_equal({ size: 1, in_use: 0, idle: 1, waiting: 0 }, db.stats)
  end

  def test_a_session_ended_by_the_server_while_idle_is_replaced_before_the_next_call
    db = client
    id = session_id(db)
    with_admin do |admin|
      kill_session(admin, id)
      wait_until("the session to end") { !session_exists?(admin, id) }
    end
    wait_for_health_check
    refute_equal id, session_id(db), "the first call after the kill succeeds, on a new connection"
  end

  def test_a_timeout_on_a_plain_thread_stops_the_query_on_the_server
    db = client
    id = session_id(db)
    marker = unique_name("sleep")
    watcher = watch_for(marker)
    thread = Thread.new do
      Timeout.timeout(QUERY_TIMEOUT) { execute(db, long_sql(marker)) }
    rescue Timeout::Error => e
      e
    end
    watcher.value
    assert_kind_of Timeout::Error, thread.value
    assert_stops_on_the_server(marker)
    assert_connection_after_interrupt(db, id)
  end

  private

  # A query that would run for 30 s, findable on the server by `marker`.
  def long_sql(marker)
    "#{sleep_sql(30)} /* #{marker} */"
  end

  # A task that finishes, with the session's id, once the server runs the
  # query marked `marker`. Returns once its admin session is connected: on a
  # loaded machine connecting can take longer than the query lives before
  # its timeout, and a watcher that connects late never sees it.
  def watch_for(marker)
    connected = Thread::Queue.new
    watcher = NeverBlock.spawn do
      with_admin do |admin|
        connected << true
        wait_until("#{marker} to start") { running_session(admin, marker) }
      end
    ensure
      connected << false
    end
    connected.pop
    watcher
  end

  def assert_stops_on_the_server(marker)
    with_admin { |admin| wait_until("#{marker} to stop on the server", seconds: 10) { running_session(admin, marker).nil? } }
  end

  # Polls the server (it tells no one when a session starts or ends).
  # @return the block's first truthy value
  def wait_until(what, seconds: 30)
    deadline = now + seconds
    loop do
      value = yield
      return value if value

      flunk "waited #{seconds} s for #{what}" if now > deadline
      sleep 0.01
    end
  end
end
