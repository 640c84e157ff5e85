# frozen_string_literal: true

# Helpers shared by the PostgreSQL tests (test/neverblock/postgres): pools
# closed and tables dropped in teardown (NeverBlockTest::PoolTracking), and a
# plain connection of its own to look at the server from outside the pool.
# Include it in a test class; it includes NeverBlockTest::Databases.
#
# (Loaded by test_helper after the NeverBlockTest class is defined.)
module NeverBlockTest::PostgresHelpers
  include NeverBlockTest::Databases
  include NeverBlockTest::PoolTracking

  private

  def client(**options)
    client_from(**pg_conninfo, **options)
  end

  # A pool with exactly these options, closed in teardown.
  def client_from(**options)
    track(NeverBlock::Postgres.pool(**options))
  end

  # A plain connection of its own, to look at the server from outside the pool.
  def with_admin
    admin = PG.connect(**pg_conninfo)
    yield admin
  ensure
    admin&.close
  end

  def drop_table(admin, table)
    admin.exec("DROP TABLE IF EXISTS #{table}")
  end

  def backend_pid(db)
    Integer(db.exec("SELECT pg_backend_pid()").getvalue(0, 0))
  end

  # The hooks of NeverBlockTest::DatabaseClientContract and ::DatabaseRecoveryContract.

  # `target`: a Client or a PG::Connection.
  def execute(target, sql)
    target.exec(sql)
  end

  def value(target, sql)
    target.exec(sql).getvalue(0, 0)
  end

  def session_id(db)
    backend_pid(db)
  end

  def in_transaction?(db)
    db.with(&:transaction_status) != PG::PQTRANS_IDLE
  end

  def sql_error
    PG::Error
  end

  def raw_connection_class
    PG::Connection
  end

  def sleep_sql(seconds)
    "SELECT pg_sleep(#{seconds})"
  end

  def database_url(database)
    pg_url.sub(%r{/[^/]*\z}, "/#{database}")
  end

  def database_option
    :dbname
  end

  def database_name
    pg_conninfo[:dbname]
  end

  def current_database_sql
    "SELECT current_database()"
  end

  # A real table (temporary ones belong to one pooled connection), dropped in teardown.
  def create_table(db)
    unique_name("t").tap do |table|
      db.exec("CREATE TABLE #{table} (id integer PRIMARY KEY)")
      @tables << table
    end
  end

  def rows_seen_by_another_session(table)
    with_admin { |admin| admin.exec("SELECT id FROM #{table} ORDER BY id").column_values(0).map(&:to_i) }
  end
end
