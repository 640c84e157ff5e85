# frozen_string_literal: true

require "test_helper"
require "neverblock/active_record"

# A connection a task leases (`Model.connection`, `lease_connection`) goes
# back to the pool when the task ends, as Rails' executor gives back a
# request's: tasks one after another share one connection, and none is
# left checked out under a fiber that has ended. One whose transaction is
# still open stays with its fiber, as the executor leaves it.
class ActiveRecordTaskLeasesTest < NeverBlockTest
  include NeverBlockTest::Databases

  class Record < ActiveRecord::Base
    self.abstract_class = true
  end

  def setup
    info = pg_conninfo
    Record.establish_connection(adapter: "neverblock_postgresql", host: info[:host], port: info[:port],
                                username: info[:user], password: info[:password], database: info[:dbname],
                                pool: 10, checkout_timeout: 1)
  end

  def teardown
    Record.connection_pool.disconnect!
    Record.remove_connection
  end

  def test_tasks_that_lease_a_connection_give_it_back_as_they_end
    pids = Array.new(8) { NeverBlock.spawn { lease.select_value("SELECT pg_backend_pid()") }.value }
    assert_equal 1, pids.uniq.size, "each task got a connection of its own: #{pids.inspect}"
    stat = Record.connection_pool.stat
    assert_equal [1, 0, 0], [stat[:connections], stat[:busy], stat.fetch(:dead, 0)], stat.inspect
  end

  def test_a_task_that_ends_inside_a_transaction_keeps_its_connection
    NeverBlock.spawn do
      lease.begin_transaction(joinable: true)
      lease.execute("SELECT 1")
    end.wait
    stat = Record.connection_pool.stat
    assert_equal 1, stat[:busy] + stat.fetch(:dead, 0), "its open transaction went back to the pool: #{stat.inspect}"
    pid = NeverBlock.spawn { lease.select_value("SELECT pg_backend_pid()") }.value
    refute_nil pid
    assert_equal 2, Record.connection_pool.stat[:connections], "the next task got another connection"
  end

  def test_a_task_that_only_uses_with_connection_is_unchanged
    pids = Array.new(4) do
      NeverBlock.spawn { Record.connection_pool.with_connection { |c| c.select_value("SELECT pg_backend_pid()") } }.value
    end
    assert_equal 1, pids.uniq.size
    assert_equal 0, Record.connection_pool.stat[:busy]
  end

  private

  # The fiber's permanent lease, as Rails 7.2+ and earlier name it.
  def lease
    Record.respond_to?(:lease_connection) ? Record.lease_connection : Record.connection
  end
end
