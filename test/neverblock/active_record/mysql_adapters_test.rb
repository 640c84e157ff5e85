# frozen_string_literal: true

require "test_helper"
require "neverblock/active_record"

# adapter: neverblock_trilogy and neverblock_mysql2, against the MariaDB that
# bin/test starts. The same behaviours for both adapters.
module ActiveRecordMySQLAdapterBehaviour
  include NeverBlockTest::Databases

  # `attribute` types under the neverblock names are the stock adapter's.
  def test_attribute_types_are_the_stock_adapters
    stock = adapter.delete_prefix("neverblock_").to_sym
    %i[string immutable_string unsigned_integer].each do |type|
      assert_equal ::ActiveRecord::Type.lookup(type, adapter: stock).class,
                   ::ActiveRecord::Type.lookup(type, adapter: adapter.to_sym).class, type
    end
    # MySQL's string type stores true as "1" (the generic one: "t").
    assert_equal "1", ::ActiveRecord::Type.lookup(:string, adapter: adapter.to_sym).serialize(true)
  end

  def setup
    config = mysql_config
    record.establish_connection(adapter: adapter, host: config[:host], port: config[:port],
                                username: config[:username], password: config[:password],
                                database: config[:database], pool: 10, checkout_timeout: 1)
    record.connection_pool.with_connection do |conn|
      conn.execute("DROP TABLE IF EXISTS #{table}")
      conn.execute("CREATE TABLE #{table} (id INT AUTO_INCREMENT PRIMARY KEY, name VARCHAR(64) NOT NULL) ENGINE=InnoDB")
    end
  end

  def teardown
    record.connection_pool.with_connection { |conn| conn.execute("DROP TABLE IF EXISTS #{table}") }
    record.connection_pool.disconnect!
    record.remove_connection
  end

  def with_conn(&block)
    record.connection_pool.with_connection(&block)
  end

  def test_the_adapter_name_resolves_to_the_neverblock_adapter
    with_conn { |conn| assert_instance_of adapter_class, conn }
  end

  def test_ten_concurrent_one_second_sleeps_finish_in_about_one_second
    took = elapsed do
      10.times.map { NeverBlock.spawn { with_conn { |c| c.select_value("SELECT SLEEP(1)") } } }.each(&:value)
    end
    assert_operator took, :<, 3, "10 x SLEEP(1) over 10 connections took #{took.round(2)} s"
  end

  def test_a_timeout_during_a_query_kills_it_on_the_server_and_the_pool_works_on
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.3) { with_conn { |c| c.execute("SELECT SLEEP(30) /* nb_ar_kill_#{adapter} */") } }
    end
    running = with_conn do |c|
      c.select_value("SELECT COUNT(*) FROM information_schema.PROCESSLIST " \
                     "WHERE INFO LIKE '%nb_ar_kill_#{adapter}%' AND INFO NOT LIKE '%PROCESSLIST%'")
    end
    assert_equal 0, running
    assert_equal 1, with_conn { |c| c.select_value("SELECT 1") }
  end

  def test_two_fibers_in_two_transactions_never_see_each_others_uncommitted_rows
    inserted = Thread::Queue.new
    checked = Thread::Queue.new
    writer = NeverBlock.spawn do
      model.transaction do
        model.create!(name: "uncommitted")
        inserted << true
        checked.pop
        raise ActiveRecord::Rollback
      end
    end
    reader = NeverBlock.spawn do
      inserted.pop
      model.where(name: "uncommitted").count.tap { checked << true }
    end
    assert_equal 0, reader.value
    writer.value
    assert_equal 0, model.count
  end

  def test_pool_exhaustion_raises_connection_timeout_error_after_checkout_timeout
    release = Thread::Queue.new
    holders = 10.times.map { NeverBlock.spawn { with_conn { |c| c.execute("SELECT 1"); release.pop } } }
    took = elapsed { assert_raises(ActiveRecord::ConnectionTimeoutError) { with_conn { |c| c.execute("SELECT 1") } } }
    assert_operator took, :>=, 0.9
    assert_operator took, :<, 5
  ensure
    10.times { release << true }
    holders&.each(&:value)
  end
end

class ActiveRecordTrilogyAdapterTest < NeverBlockTest
  include ActiveRecordMySQLAdapterBehaviour

  class Record < ActiveRecord::Base
    self.abstract_class = true
  end

  class Item < Record
    self.table_name = "nb_ar_trilogy_items"
  end

  def adapter = "neverblock_trilogy"
  def adapter_class = NeverBlock::ActiveRecord::TrilogyAdapter
  def record = Record
  def model = Item
  def table = Item.table_name
end

class ActiveRecordMysql2AdapterTest < NeverBlockTest
  include ActiveRecordMySQLAdapterBehaviour

  class Record < ActiveRecord::Base
    self.abstract_class = true
  end

  class Item < Record
    self.table_name = "nb_ar_mysql2_items"
  end

  def adapter = "neverblock_mysql2"
  def adapter_class = NeverBlock::ActiveRecord::Mysql2Adapter
  def record = Record
  def model = Item
  def table = Item.table_name
end
