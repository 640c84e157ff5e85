# frozen_string_literal: true

require "test_helper"

# The scheduler's own resources and state.
class SchedulerLifecycleTest < PlainTest
  def test_rejected_options_leave_no_descriptors_open
    before = NeverBlock::Testing.open_descriptors.size
    5.times do
      assert_raises(ArgumentError) { NeverBlock.run(thread_pool_size: 0) { 1 } }
      assert_raises(ArgumentError) { NeverBlock.run(stall_threshold: -1) { 1 } }
    end
    assert_equal before, NeverBlock::Testing.open_descriptors.size
  end

  def test_a_failing_run_block_does_not_cancel_other_fibers_of_a_raw_scheduler
    finished = false
    thread = Thread.new do
      scheduler = NeverBlock::Scheduler.new
      Fiber.set_scheduler(scheduler)
      begin
        scheduler.run { raise "block failed" }
      rescue RuntimeError
        nil
      end
      Fiber.schedule do
        sleep 0.02
        finished = true
      end
    end
    thread.join
    assert finished, "close ran the loop to the end instead of cancelling"
  end

  def test_pool_shutdown_counts_a_block_handed_to_an_idle_fiber
    pool = NeverBlock::FiberPool.new(size: 1)
    NeverBlock.run do
      pool.spawn { :warm_up }.wait
      handed = pool.spawn { :late } # given to the idle fiber; starts next turn
      assert pool.shutdown(1)
      assert handed.finished?, "shutdown returned before the handed-over block ran"
      assert_equal :late, handed.value
    end
  end
end
