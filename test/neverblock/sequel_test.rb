# frozen_string_literal: true

require "test_helper"
require "sequel"

# Sequel with its fiber_concurrency extension (connections belong to fibers,
# not threads) and the postgres adapter runs concurrently inside NeverBlock,
# with nothing from NeverBlock but the loop: pg waits on its socket through
# the fiber scheduler, and Sequel's pool waits on a Mutex and
# ConditionVariable, which suspend only the fiber.
class SequelTest < NeverBlockTest
  include NeverBlockTest::Databases

  # Process-wide (Sequel.current becomes Fiber.current); harmless to code
  # that runs on plain threads, where each thread's fiber stands for it.
  Sequel.extension :fiber_concurrency

  def setup
    @db = Sequel.connect(pg_url, max_connections: 10, pool_timeout: 5)
  end

  def teardown
    @db.disconnect
  end

  def test_ten_concurrent_one_second_sleeps_take_about_a_second
    time = elapsed do
      10.times.map { NeverBlock.spawn { @db.get(Sequel.function(:pg_sleep, 1)) } }.each(&:value)
    end
    assert_operator time, :<, 3, "ten one-second queries ran one after another"
    assert_equal 10, @db.pool.size, "each fiber had a connection of its own"
  end

  def test_each_fiber_gets_its_own_connection_and_keeps_it_in_a_transaction
    pids = 4.times.map do
      NeverBlock.spawn do
        @db.transaction do
          first = @db.get(Sequel.function(:pg_backend_pid))
          sleep 0.05 # the other fibers run their transactions meanwhile
          [first, @db.get(Sequel.function(:pg_backend_pid))]
        end
      end
    end.map(&:value)
    pids.each { |first, second| assert_equal first, second }
    assert_equal 4, pids.map(&:first).uniq.size, "two fibers shared a connection"
  end
end
