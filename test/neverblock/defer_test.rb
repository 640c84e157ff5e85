# frozen_string_literal: true

require "test_helper"

# NeverBlock.defer: blocking work on the loop's thread pool.
class DeferTest < NeverBlockTest
  def test_defer_returns_the_block_value
    assert_equal 6, NeverBlock.defer { 2 * 3 }
  end

  def test_defer_runs_the_block_on_another_thread
    refute_same Thread.current, NeverBlock.defer { Thread.current }
  end

  def test_defer_reraises_the_block_exception
    error = assert_raises(ZeroDivisionError) { NeverBlock.defer { 1 / 0 } }
    assert_match(/divided/, error.message)
  end

  def test_defer_suspends_only_the_calling_fiber
    ticks = 0
    ticker = NeverBlock.spawn { 10.times { sleep 0.01; ticks += 1 } }
    # A GVL-releasing blocking call that would freeze the loop if run inline.
    NeverBlock.defer { IO.select(nil, nil, nil, 0.2) }
    ticker.wait
    assert_equal 10, ticks
  end

  def test_deferred_blocks_run_in_parallel_up_to_the_pool_size
    time = elapsed { 4.times.map { NeverBlock.spawn { NeverBlock.defer { IO.select(nil, nil, nil, 0.2) } } }.each(&:wait) }
    assert_operator time, :<, 0.6
  end

  def test_a_timeout_abandons_the_deferred_result
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.02) { NeverBlock.defer { IO.select(nil, nil, nil, 0.1) } } }
    assert_equal :later, NeverBlock.defer { :later }
  end

  def test_defer_without_a_block_is_an_argument_error
    assert_raises(ArgumentError) { NeverBlock.defer }
  end
end

# Outside a loop defer just calls the block.
class DeferOutsideLoopTest < PlainTest
  def test_defer_outside_a_loop_runs_inline
    assert_same Thread.current, NeverBlock.defer { Thread.current }
  end

  def test_the_pool_size_is_validated
    assert_raises(ArgumentError) { NeverBlock.run(thread_pool_size: 0) { 1 } }
    assert_raises(ArgumentError) { NeverBlock.thread_pool_size = -1 }
  end

  def test_a_pool_of_one_thread_queues_jobs_fifo
    order = []
    NeverBlock.run(thread_pool_size: 1) do
      3.times.map { |i| NeverBlock.spawn { NeverBlock.defer { order << i } } }.each(&:wait)
    end
    assert_equal [0, 1, 2], order
  end

  def test_pool_threads_are_gone_after_the_loop
    before = Thread.list.size
    NeverBlock.run { 3.times.map { NeverBlock.spawn { NeverBlock.defer { sleep 0.01 } } }.each(&:wait) }
    assert_equal before, Thread.list.count(&:alive?)
  end
end
