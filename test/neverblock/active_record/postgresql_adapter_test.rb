# frozen_string_literal: true

require "test_helper"
require "neverblock/active_record"

# adapter: neverblock_postgresql, against the PostgreSQL that bin/test starts.
class ActiveRecordPostgreSQLAdapterTest < NeverBlockTest
  include NeverBlockTest::Databases

  # A model of its own, so that the test owns its connection pool.
  class Record < ActiveRecord::Base
    self.abstract_class = true
  end

  class Item < Record
    self.table_name = "nb_ar_items"
  end

  def setup
    info = pg_conninfo
    Record.establish_connection(adapter: "neverblock_postgresql", host: info[:host], port: info[:port],
                                username: info[:user], password: info[:password], database: info[:dbname],
                                pool: 10, checkout_timeout: 1)
    Record.connection_pool.with_connection do |conn|
      conn.execute("DROP TABLE IF EXISTS nb_ar_items")
      conn.execute("CREATE TABLE nb_ar_items (id serial PRIMARY KEY, name text NOT NULL)")
    end
  end

  def teardown
    Record.connection_pool.with_connection { |conn| conn.execute("DROP TABLE IF EXISTS nb_ar_items") }
    Record.connection_pool.disconnect!
    Record.remove_connection
  end

  def test_the_adapter_name_in_database_yml_resolves_to_the_neverblock_adapter_reporting_postgresql
    Record.connection_pool.with_connection do |conn|
      assert_instance_of NeverBlock::ActiveRecord::PostgreSQLAdapter, conn
      assert_equal "PostgreSQL", conn.adapter_name
      assert_instance_of NeverBlock::Postgres::Connection, conn.raw_connection
    end
  end

  # What the server's status endpoint shows (GET status_path renders stats).
  def test_the_server_stats_list_active_record_pools_that_have_connections
    require "neverblock/server"
    Record.connection_pool.with_connection { |c| c.execute("SELECT 1") }
    server = NeverBlock::Server.new(->(_env) { [200, {}, []] }, bind: "tcp://127.0.0.1:0", workers: 0)
    serving = NeverBlock.spawn { server.run }
    NeverBlock.sleep(0.05)
    pools = server.stats[:active_record_pools]
    server.stop
    serving.wait
    pool = pools.find { |entry| entry[:adapter] == "neverblock_postgresql" }
    refute_nil pool, pools.inspect
    assert_equal 10, pool[:size]
    assert_operator pool[:connections], :>=, 1
    assert_equal 0, pool[:busy]
  end

  # `attribute` types are looked up by the adapter name in database.yml:
  # under neverblock_postgresql they are the stock adapter's types.
  def test_attribute_types_are_the_postgresql_adapters
    Record.connection_pool.with_connection do |c|
      c.execute("DROP TABLE IF EXISTS nb_ar_typed")
      c.execute("CREATE TABLE nb_ar_typed (id serial PRIMARY KEY, data bytea, doc jsonb, token uuid, numbers int[], " \
                "span interval, address inet)")
    end
    # Defined here: ActiveRecord resolves `attribute` types when the class is
    # defined, from the adapter of the connection established in setup.
    typed = self.class.const_get(:Typed) if self.class.const_defined?(:Typed, false)
    typed ||= self.class.const_set(:Typed, Class.new(Record) do
      self.table_name = "nb_ar_typed"
      attribute :data, :binary
      attribute :doc, :jsonb
      attribute :token, :uuid
      attribute :numbers, :integer, array: true
      attribute :span, :interval
      attribute :address, :inet
    end)
    bytes = (0..255).map(&:chr).join.b
    record = typed.create!(data: bytes, doc: { "a" => [1, 2] }, token: "6f1b7e0a-3b8e-4a1b-9c1d-0123456789ab",
                           numbers: [1, 2, 3], span: 90.minutes, address: "10.0.0.1")
    loaded = typed.find(record.id)
    assert_equal bytes, loaded.data, "bytea came back as text"
    assert_equal({ "a" => [1, 2] }, loaded.doc)
    assert_equal [1, 2, 3], loaded.numbers
    assert_equal 90.minutes, loaded.span
    assert_equal IPAddr.new("10.0.0.1"), loaded.address
    assert_instance_of ::ActiveRecord::ConnectionAdapters::PostgreSQL::OID::Jsonb,
                       ::ActiveRecord::Type.lookup(:jsonb, adapter: :neverblock_postgresql)
  ensure
    Record.connection_pool.with_connection { |c| c.execute("DROP TABLE IF EXISTS nb_ar_typed") }
  end

  # Rails documents `ActiveRecord::ConnectionAdapters::PostgreSQLAdapter.datetime_type = :timestamptz`
  # to make `t.datetime` a timestamp with time zone. The stock class keeps the
  # type table that setting produces in a class-level cache, which Rails' own
  # tests rebuild after changing the setting (with_datetime_type below does the
  # same): the neverblock adapter must use that table, not a stale copy of its own.
  def test_datetime_type_set_on_the_stock_adapter_applies_to_neverblock_connections
    Record.connection_pool.with_connection do |c|
      c.create_table(:nb_ar_times, force: true) { |t| t.datetime :before } # the type table is in use
      with_datetime_type(:timestamptz) { c.add_column(:nb_ar_times, :after, :datetime) }
      c.add_column(:nb_ar_times, :later, :datetime)
      types = c.select_rows("SELECT column_name, data_type FROM information_schema.columns " \
                            "WHERE table_name = 'nb_ar_times'").to_h
      assert_equal "timestamp without time zone", types["before"]
      assert_equal "timestamp with time zone", types["after"]
      assert_equal "timestamp without time zone", types["later"], "the setting was restored"
    end
  ensure
    Record.connection_pool.with_connection { |c| c.execute("DROP TABLE IF EXISTS nb_ar_times") }
  end

  def with_datetime_type(type)
    stock = ::ActiveRecord::ConnectionAdapters::PostgreSQLAdapter
    was = stock.datetime_type
    stock.datetime_type = type
    stock.remove_instance_variable(:@native_database_types) if stock.instance_variable_defined?(:@native_database_types)
    yield
  ensure
    stock.datetime_type = was
    stock.remove_instance_variable(:@native_database_types) if stock.instance_variable_defined?(:@native_database_types)
  end

  def test_requiring_it_sets_the_fiber_isolation_level
    assert_equal :fiber, ActiveSupport::IsolatedExecutionState.isolation_level
  end

  def test_each_fiber_gets_its_own_connection
    pids = 3.times.map do
      NeverBlock.spawn { Record.connection_pool.with_connection { |c| c.select_value("SELECT pg_backend_pid() FROM pg_sleep(0.2)") } }
    end.map(&:value)
    assert_equal 3, pids.uniq.size
  end

  def test_ten_concurrent_one_second_sleeps_finish_in_about_one_second
    took = elapsed do
      10.times.map do
        NeverBlock.spawn { Record.connection_pool.with_connection { |c| c.execute("SELECT pg_sleep(1)") } }
      end.each(&:value)
    end
    assert_operator took, :<, 3, "10 x pg_sleep(1) over 10 connections took #{took.round(2)} s"
  end

  class StockRecord < ActiveRecord::Base
    self.abstract_class = true
  end

  # The stock adapter too, at the fiber isolation level (what NeverBlock's
  # Railtie and server set): each fiber has its own connection, and pg's
  # waits suspend only their fiber. (Without the cancel on timeouts that
  # the neverblock adapter adds.)
  def test_the_stock_postgresql_adapter_gives_each_fiber_its_own_connection_and_runs_concurrently
    info = pg_conninfo
    StockRecord.establish_connection(adapter: "postgresql", host: info[:host], port: info[:port], username: info[:user],
                                     password: info[:password], database: info[:dbname], pool: 10, checkout_timeout: 5)
    pids = nil
    took = elapsed do
      pids = 10.times.map do
        NeverBlock.spawn do
          StockRecord.connection_pool.with_connection { |c| c.select_value("SELECT pg_backend_pid() FROM pg_sleep(1)") }
        end
      end.map(&:value)
    end
    assert_equal 10, pids.uniq.size
    assert_operator took, :<, 3, "10 x pg_sleep(1) on the stock adapter took #{took.round(2)} s"
  ensure
    StockRecord.connection_pool.disconnect!
    StockRecord.remove_connection
  end

  def test_two_fibers_in_two_transactions_never_see_each_others_uncommitted_rows
    inserted = Thread::Queue.new
    checked = Thread::Queue.new
    writer = NeverBlock.spawn do
      Item.transaction do
        Item.create!(name: "uncommitted")
        inserted << true
        checked.pop
        raise ActiveRecord::Rollback
      end
    end
    reader = NeverBlock.spawn do
      inserted.pop
      Item.transaction { Item.where(name: "uncommitted").count }.tap { checked << true }
    end
    assert_equal 0, reader.value
    writer.value
    assert_equal 0, Item.count
  end

  def test_a_committed_transaction_is_visible_to_other_fibers
    NeverBlock.spawn { Item.transaction { Item.create!(name: "committed") } }.value
    assert_equal 1, NeverBlock.spawn { Item.where(name: "committed").count }.value
  end

  def test_pool_exhaustion_raises_connection_timeout_error_after_checkout_timeout
    release = Thread::Queue.new
    holders = 10.times.map do
      NeverBlock.spawn { Record.connection_pool.with_connection { |c| c.execute("SELECT 1"); release.pop } }
    end
    error = nil
    took = elapsed do
      error = assert_raises(ActiveRecord::ConnectionTimeoutError) do
        Record.connection_pool.with_connection { |c| c.execute("SELECT 1") }
      end
    end
    assert_operator took, :>=, 0.9
    assert_operator took, :<, 5
    assert_match(/could not obtain a connection/, error.message)
  ensure
    10.times { release << true }
    holders&.each(&:value)
  end

  def test_a_timeout_during_a_query_cancels_it_on_the_server
    pid = nil
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.3) do
        Record.connection_pool.with_connection do |c|
          pid = c.select_value("SELECT pg_backend_pid()")
          c.execute("SELECT pg_sleep(30) /* nb_ar_cancel */")
        end
      end
    end
    Record.connection_pool.with_connection do |c|
      active = c.select_value("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' " \
                              "AND query LIKE '%nb_ar_cancel%' AND pid <> pg_backend_pid()")
      assert_equal 0, active
      assert_equal pid, c.select_value("SELECT pg_backend_pid()"), "the same connection should be reused"
    end
  end

  def test_a_timeout_inside_a_transaction_rolls_it_back_and_the_connection_works_on
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.3) do
        Item.transaction do
          Item.create!(name: "doomed")
          Item.connection.execute("SELECT pg_sleep(30)")
        end
      end
    end
    assert_equal 0, Item.count
    Item.create!(name: "after")
    assert_equal ["after"], Item.pluck(:name)
  end

  # A TCP proxy whose answers from the server arrive `delay` seconds late,
  # on threads of its own (no scheduler): a way to interrupt a client
  # while a statement it sent has already run on the server.
  class SlowReplies
    attr_reader :port

    def initialize(host, port, delay)
      @server = TCPServer.new("127.0.0.1", 0)
      @port = @server.addr[1]
      @threads = []
      @acceptor = Thread.new do
        loop do
          client = @server.accept
          upstream = TCPSocket.new(host, port)
          @threads << pump(client, upstream, 0) << pump(upstream, client, delay)
        end
      rescue IOError, SystemCallError
        nil
      end
    end

    def close
      @server.close
      @acceptor.join
      @threads.each(&:kill).each(&:join)
    end

    private

    def pump(from, to, delay)
      Thread.new do
        while (data = from.readpartial(65_536))
          sleep(delay) if delay.positive?
          to.write(data)
        end
      rescue IOError, SystemCallError
        to.close unless to.closed?
      end
    end
  end

  # The server ran the BEGIN, its answer was on the way when the timeout
  # fired: the connection must not go back with that transaction open, or
  # the next autocommit INSERT on it joins the transaction and is lost
  # with it.
  def test_a_timeout_during_begin_leaves_no_transaction_open_on_the_connection
    info = pg_conninfo
    proxy = SlowReplies.new(info[:host], info[:port], 0.05)
    Record.establish_connection(adapter: "neverblock_postgresql", host: "127.0.0.1", port: proxy.port,
                                username: info[:user], password: info[:password], database: info[:dbname], pool: 1)
    Item.first # connected, the schema loaded
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.02) { Item.transaction { Item.create!(name: "never") } }
    end
    # An autocommit write (no transaction of ActiveRecord's), on the same (only) connection.
    Item.connection.execute("INSERT INTO nb_ar_items (name) VALUES ('acknowledged')")
    Record.connection_pool.disconnect! # closing rolls back whatever is still open
    Record.establish_connection(adapter: "neverblock_postgresql", host: info[:host], port: info[:port],
                                username: info[:user], password: info[:password], database: info[:dbname], pool: 2)
    assert_equal ["acknowledged"], Item.pluck(:name)
  ensure
    Record.connection_pool.disconnect!
    proxy&.close
  end

  class Account < Record
    self.table_name = "nb_ar_accounts"
  end

  # Transfers under random timeouts, some firing during BEGIN or COMMIT,
  # between acknowledged autocommit writes on the same connections. A
  # timed-out BEGIN that the server ran must not leave the connection in a
  # transaction ActiveRecord does not know about (the next owner's
  # acknowledged INSERT would be rolled back with it), and every timeout
  # surfaces as the timeout error.
  def test_transfers_under_random_timeouts_keep_the_balance_and_lose_no_acknowledged_write
    Record.connection_pool.with_connection do |c|
      c.execute("DROP TABLE IF EXISTS nb_ar_accounts")
      c.execute("CREATE TABLE nb_ar_accounts (id int PRIMARY KEY, balance int NOT NULL)")
      c.execute("INSERT INTO nb_ar_accounts SELECT id, 100 FROM generate_series(1, 20) AS id")
    end
    Account.first # the schema, loaded once
    # Ten connections open and configured first (a new one loads the type map, ~50 ms).
    10.times.map do
      NeverBlock.spawn { Record.connection_pool.with_connection { |c| c.execute("SELECT pg_sleep(0.05)") } }
    end.each(&:value)
    random = Random.new(Integer(ENV.fetch("NEVERBLOCK_FUZZ_SEED", rand(1 << 30))))
    acknowledged = []
    outcomes = Hash.new(0)
    workers = 10.times.map do |worker|
      NeverBlock.spawn do
        20.times do |i|
          amount = random.rand(1..50)
          from, to = (1..20).to_a.sample(2, random: random)
          begin
            # Log-uniform from 0.5 ms to 200 ms: timeouts land in every phase
            # of a transfer however slow a loaded machine makes it.
            NeverBlock.timeout(10**random.rand(-3.3..-0.7)) do
              Account.transaction do # rows locked in id order: no deadlocks
                [[from, -amount], [to, amount]].sort.each_with_index do |(id, change), step|
                  Account.connection.execute("SELECT pg_sleep(0.001)") if step == 1 && random.rand < 0.3
                  Account.where(id: id).update_all(["balance = balance + ?", change])
                end
              end
            end
            outcomes[:committed] += 1
          rescue NeverBlock::TimeoutError
            outcomes[:timed_out] += 1
          end
          name = "ack-#{worker}-#{i}"
          # Autocommit (no transaction of ActiveRecord's), no timeout: acknowledged once it returns.
          Item.connection.execute("INSERT INTO nb_ar_items (name) VALUES ('#{name}')")
          acknowledged << name
        ensure
          Record.connection_pool.release_connection
        end
      end
    end
    workers.each(&:value)
    Record.connection_pool.disconnect! # a transaction left open on the server is rolled back now
    assert_equal 2000, Account.sum(:balance), "the transfers' invariant broke: #{outcomes.inspect}"
    assert_equal acknowledged.sort, Item.pluck(:name).sort, "acknowledged writes were lost: #{outcomes.inspect}"
    # Timeouts hit every phase, and did not leave locks behind that fail later
    # transfers: some committed during the storm (how many depends on how loaded
    # the machine is: 18 of 200 beside two other suites), and one more now, with
    # time enough, on every account.
    assert_operator outcomes[:timed_out], :>, 20, outcomes.inspect
    assert_operator outcomes[:committed], :>, 0, outcomes.inspect
    NeverBlock.timeout(10) do
      Account.transaction { (1..20).each { |id| Account.where(id: id).update_all("balance = balance") } }
    end
  ensure
    Record.connection_pool.with_connection { |c| c.execute("DROP TABLE IF EXISTS nb_ar_accounts") }
  end

  def test_an_sql_error_raises_in_its_fiber_only_and_the_transaction_is_rolled_back
    failing = NeverBlock.spawn do
      Item.transaction do
        Item.create!(name: "rolled back")
        Item.connection.execute("SELECT * FROM no_such_table")
      end
    end
    fine = NeverBlock.spawn { Item.transaction { Item.create!(name: "kept") } }
    assert_raises(ActiveRecord::StatementInvalid) { failing.value }
    fine.value
    assert_equal ["kept"], Item.pluck(:name)
  end

  def test_a_missing_database_raises_no_database_error
    info = pg_conninfo
    Record.establish_connection(adapter: "neverblock_postgresql", host: info[:host], port: info[:port],
                                username: info[:user], password: info[:password], database: "nb_no_such_db")
    assert_raises(ActiveRecord::NoDatabaseError) { Record.connection_pool.with_connection { |c| c.execute("SELECT 1") } }
  ensure
    setup
  end
end
