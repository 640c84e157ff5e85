# frozen_string_literal: true

require "test_helper"
require "securerandom"
require "neverblock/postgres"

# What happens to a query and its pooled connection when the caller gives up
# half-way or the server ends the session (NeverBlockTest::DatabaseRecoveryContract),
# on PostgreSQL: the query is cancelled on the server, the same connection
# goes back to the pool, and pg_stat_activity shows it from the server's side.
class PostgresRecoveryTest < NeverBlockTest
  include NeverBlockTest::PostgresHelpers
  include NeverBlockTest::DatabaseRecoveryContract

  private

  def client(size: 1, **options)
    client_from(size: size, **pg_conninfo, **options)
  end

  # The pid of the session running the query that contains `marker`, or nil.
  def running_session(admin, marker)
    pid = admin.exec_params(<<~SQL, ["%#{marker}%"]).getvalue(0, 0)
      SELECT max(pid) FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1 AND pid <> pg_backend_pid()
    SQL
    pid && Integer(pid)
  end

  def kill_session(admin, pid)
    admin.exec_params("SELECT pg_terminate_backend($1)", [pid])
  end

  def session_exists?(admin, pid)
    admin.exec_params("SELECT 1 FROM pg_stat_activity WHERE pid = $1", [pid]).ntuples.positive?
  end

  # A statement that ignores cancel requests for 1.5 s, so that recovery
  # (cancel, then wait for the server) is still going on when the outer
  # timeouts fire.
  def stubborn_sql(db)
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
    "SELECT pg_temp.nb_stubborn_sleep()"
  end

  # A connection is checked before it is lent once it has been back in the
  # pool this long (one back for less was just used): the sleep is the
  # behaviour under test.
  def wait_for_health_check
    sleep NeverBlock::Postgres::Client::HEALTH_CHECK_AFTER
  end

  # The cancelled query left the session usable: the same one comes back.
  def assert_connection_after_interrupt(db, pid)
    assert_equal 0, db.stats[:in_use]
    assert_equal pid, backend_pid(db), "the same connection came back to the pool, and works"
  end
  alias assert_connection_after_interrupted_transaction assert_connection_after_interrupt
end
