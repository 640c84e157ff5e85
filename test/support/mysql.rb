# frozen_string_literal: true

# Helpers shared by the MariaDB tests (test/neverblock/mysql), which run once
# per driver: the including class defines `driver` (:trilogy or :mysql2).
# Pools closed and tables dropped in teardown (NeverBlockTest::PoolTracking),
# and a session of its own to look at the server from outside the pool.
# Include it in a test class or module; it includes NeverBlockTest::Databases.
# It loads no driver itself.
#
# (Loaded by test_helper after the NeverBlockTest class is defined.)
module NeverBlockTest::MySQLHelpers
  include NeverBlockTest::Databases
  include NeverBlockTest::PoolTracking

  private

  def driver_error
    driver == :trilogy ? Trilogy::Error : Mysql2::Error
  end

  # Rows as arrays, whichever the driver.
  def rows(result)
    result.respond_to?(:rows) ? result.rows : result.map(&:values)
  end

  def connection_id(db)
    rows(db.query("SELECT CONNECTION_ID()")).first.first
  end

  # A pool on the test database with this driver, closed in teardown.
  def client(**options)
    client_from(**mysql_config, **options)
  end

  # A pool with exactly these options (and this driver), closed in teardown.
  def client_from(**options)
    track(NeverBlock::MySQL.pool(driver: driver, **options))
  end

  # The hooks of NeverBlockTest::DatabaseClientContract and ::DatabaseRecoveryContract.

  # `target`: a Client or the driver's connection.
  def execute(target, sql)
    target.query(sql)
  end

  def value(target, sql)
    rows(target.query(sql)).first.first&.to_s
  end

  def session_id(db)
    connection_id(db)
  end

  def in_transaction?(db)
    rows(db.query("SELECT @@in_transaction")) == [[1]]
  end

  def sql_error
    driver_error
  end

  def raw_connection_class
    driver == :trilogy ? Trilogy : Mysql2::Client
  end

  def sleep_sql(seconds)
    "SELECT SLEEP(#{seconds})"
  end

  def database_url(database)
    config = mysql_config
    "mysql://#{config[:username]}:#{config[:password]}@#{config[:host]}:#{config[:port]}/#{database}"
  end

  def database_option
    :database
  end

  def database_name
    mysql_config[:database]
  end

  def current_database_sql
    "SELECT DATABASE()"
  end

  # A session of its own, to look at the server from outside the pool. Opened
  # on the thread pool, as NeverBlock::MySQL opens its own: Trilogy.new on the
  # loop can leave a stale epoll registration behind (see TrilogyConnection).
  def with_admin
    admin = NeverBlock.defer { Trilogy.new(mysql_config) }
    yield admin
  ensure
    admin&.close
  end

  def drop_table(admin, table)
    admin.query("DROP TABLE IF EXISTS #{table}")
  end

  # An InnoDB table, dropped in teardown.
  def create_table(db)
    unique_name("t").tap do |table|
      db.query("CREATE TABLE #{table} (id integer PRIMARY KEY) ENGINE=InnoDB")
      @tables << table
    end
  end

  def rows_seen_by_another_session(table)
    with_admin { |admin| admin.query("SELECT id FROM #{table} ORDER BY id").rows.map(&:first) }
  end
end
