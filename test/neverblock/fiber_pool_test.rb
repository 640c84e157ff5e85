# frozen_string_literal: true

require "test_helper"

# NeverBlock::FiberPool: bounded, reusing, FIFO, with backpressure.
class FiberPoolTest < NeverBlockTest
  def test_spawn_returns_a_task_with_the_block_value
    pool = NeverBlock::FiberPool.new(size: 2)
    assert_equal :pooled, pool.spawn { :pooled }.value
  end

  def test_never_more_than_size_blocks_run_at_once
    pool = NeverBlock::FiberPool.new(size: 3)
    running = 0
    peak = 0
    tasks = 20.times.map do
      pool.spawn do
        running += 1
        peak = [peak, running].max
        sleep 0.01
        running -= 1
      end
    end
    NeverBlock.wait_all(tasks)
    assert_equal 3, peak
  end

  def test_fibers_are_reused_not_created_per_block
    pool = NeverBlock::FiberPool.new(size: 2)
    fibers = 10.times.map { pool.spawn { sleep 0.001; Fiber.current } }.map(&:value)
    assert_equal 2, fibers.uniq.size
  end

  def test_a_deferred_spawn_lets_the_caller_go_on_and_starts_the_blocks_in_order_on_the_next_turn
    pool = NeverBlock::FiberPool.new(size: 10)
    order = []
    tasks = 5.times.map do |i|
      pool.spawn(defer: true) { order << i }.tap { order << :"spawned#{i}" }
    end
    assert_equal (0..4).map { |i| :"spawned#{i}" }, order, "a block ran before its caller gave up its turn"
    assert_equal [:pending] * 5, tasks.map(&:status)
    NeverBlock.wait_all(tasks)
    assert_equal [0, 1, 2, 3, 4], order.last(5)
    eager = []
    NeverBlock::FiberPool.new(size: 1).spawn { eager << :ran }
    assert_equal [:ran], eager, "without defer: a new fiber runs the block at once"
  end

  def test_waiting_blocks_run_in_fifo_order
    pool = NeverBlock::FiberPool.new(size: 1)
    order = []
    10.times.map { |i| pool.spawn { order << i } }.each(&:wait)
    assert_equal (0..9).to_a, order
  end

  def test_spawn_beyond_the_queue_limit_raises_pool_full
    pool = NeverBlock::FiberPool.new(size: 2, queue_limit: 3)
    tasks = 5.times.map { pool.spawn { sleep 0.05 } }
    error = assert_raises(NeverBlock::PoolFull) { pool.spawn { :too_many } }
    assert_match(/queue_limit 3/, error.message)
    assert_kind_of NeverBlock::Error, error
    tasks.each(&:wait)
    assert_equal :room_again, pool.spawn { :room_again }.value, "nothing was lost; the pool accepts work again"
  end

  def test_a_queue_limit_of_zero_means_no_waiting
    pool = NeverBlock::FiberPool.new(size: 1, queue_limit: 0)
    first = pool.spawn { sleep 0.01 }
    assert_raises(NeverBlock::PoolFull) { pool.spawn { :no } }
    first.wait
  end

  def test_stats
    pool = NeverBlock::FiberPool.new(size: 2, queue_limit: 10)
    assert_equal({ size: 2, busy: 0, idle: 0, queued: 0, completed: 0 }, pool.stats)
    tasks = 5.times.map { pool.spawn { sleep 0.02 } }
    assert_equal({ size: 2, busy: 2, idle: 0, queued: 3, completed: 0 }, pool.stats)
    tasks.each(&:wait)
    assert_equal({ size: 2, busy: 0, idle: 2, queued: 0, completed: 5 }, pool.stats)
  end

  # A burst of 1,000 blocks runs in 1,000 fibers; once it is over the pool
  # keeps IDLE_LIMIT of them (their memory reused) and the rest end (theirs
  # goes back to Ruby and the kernel).
  def test_after_a_burst_at_most_idle_limit_fibers_are_kept
    pool = NeverBlock::FiberPool.new(size: 1000)
    assert_equal NeverBlock::FiberPool::IDLE_LIMIT, pool.idle_limit
    gate = Thread::Queue.new # all 1,000 run at once
    tasks = 1000.times.map { pool.spawn { gate.pop; Fiber.current } }
    1000.times { gate << true }
    fibers = tasks.map(&:value)
    assert_equal 1000, fibers.uniq.size
    assert_equal NeverBlock::FiberPool::IDLE_LIMIT, pool.stats[:idle]
    assert_equal NeverBlock::FiberPool::IDLE_LIMIT, fibers.count(&:alive?)
    assert_equal 10, 10.times.map { pool.spawn { sleep 0.001; Fiber.current } }.map(&:value).count { |fiber| fibers.include?(fiber) },
                 "the kept fibers are reused"
  end

  def test_an_idle_limit_of_zero_keeps_no_fiber
    pool = NeverBlock::FiberPool.new(size: 4, idle_limit: 0)
    fibers = 4.times.map { pool.spawn { sleep 0.01; Fiber.current } }.map(&:value)
    assert_equal 0, pool.stats[:idle]
    assert fibers.none?(&:alive?)
    assert_equal :again, pool.spawn { :again }.value
  end

  def test_full_while_every_fiber_is_busy
    pool = NeverBlock::FiberPool.new(size: 2)
    refute pool.full?
    first = pool.spawn { sleep 0.02 }
    refute pool.full?
    second = pool.spawn { sleep 0.02 }
    assert pool.full?
    [first, second].each(&:wait)
    refute pool.full?, "its fibers are idle again"
  end

  def test_a_failing_block_does_not_kill_the_worker
    pool = NeverBlock::FiberPool.new(size: 1)
    failing = pool.spawn { raise "pooled failure" }
    assert_raises(RuntimeError) { failing.value }
    assert_equal :next, pool.spawn { :next }.value
    assert_equal 2, pool.stats[:completed]
  end

  def test_fiber_locals_do_not_leak_between_blocks
    pool = NeverBlock::FiberPool.new(size: 1)
    pool.spawn { Thread.current[:user] = "alice" }.wait
    assert_nil pool.spawn { Thread.current[:user] }.value
  end

  def test_cancel_a_queued_block_frees_its_place
    pool = NeverBlock::FiberPool.new(size: 1, queue_limit: 1)
    running = pool.spawn { sleep 0.05 }
    queued = pool.spawn { :never }
    queued.cancel
    assert_equal 0, pool.stats[:queued]
    assert_raises(NeverBlock::Cancelled) { queued.value }
    another = pool.spawn { :accepted }
    running.wait
    assert_equal :accepted, another.value
  end

  def test_cancel_a_running_block_and_the_worker_carries_on
    pool = NeverBlock::FiberPool.new(size: 1)
    long = pool.spawn { sleep 10 }
    after = pool.spawn { :after }
    sleep 0.01
    long.cancel
    assert_raises(NeverBlock::Cancelled) { long.value }
    assert_equal :after, after.value
  end

  def test_shutdown_waits_for_running_and_queued_blocks
    pool = NeverBlock::FiberPool.new(size: 2)
    done = []
    4.times { |i| pool.spawn { sleep 0.02; done << i } }
    assert pool.shutdown(5)
    assert_equal 4, done.size
    assert pool.closed?
    assert_raises(NeverBlock::PoolClosed) { pool.spawn { :late } }
  end

  def test_shutdown_with_a_timeout_cancels_what_is_left
    pool = NeverBlock::FiberPool.new(size: 1)
    cleaned = []
    slow = pool.spawn do
      sleep 10
    ensure
      cleaned << :slow
    end
    queued = pool.spawn { :never }
    refute pool.shutdown(0.05)
    assert_equal [:slow], cleaned
    assert slow.cancelled?
    assert queued.cancelled?
  end

  def test_spawn_outside_a_loop_raises_no_reactor_error
    pool = NeverBlock::FiberPool.new
    assert_raises(NeverBlock::NoReactorError) { Thread.new { Thread.current.report_on_exception = false; pool.spawn { 1 } }.value }
  end

  def test_invalid_sizes_raise_argument_error
    [0, -1, 1.5, Float::NAN, nil].each do |bad|
      assert_raises(ArgumentError, bad.inspect) { NeverBlock::FiberPool.new(size: bad) }
    end
    assert_raises(ArgumentError) { NeverBlock::FiberPool.new(queue_limit: -1) }
    assert_raises(ArgumentError) { NeverBlock::FiberPool.new(idle_limit: -1) }
    assert_raises(ArgumentError) { NeverBlock::FiberPool.new(idle_limit: 1.5) }
    assert_raises(ArgumentError) { NeverBlock::FiberPool.new.shutdown(-1) }
  end

  def test_concurrent_blocks_overlap
    pool = NeverBlock::FiberPool.new(size: 10)
    time = elapsed { 10.times.map { pool.spawn { sleep 0.2 } }.each(&:wait) }
    assert_operator time, :<, 1
  end
end

# A pool outlives one loop and serves the next.
class FiberPoolAcrossLoopsTest < PlainTest
  def test_a_pool_can_be_used_in_successive_loops
    pool = NeverBlock::FiberPool.new(size: 2)
    assert_equal 1, NeverBlock.run { pool.spawn { 1 }.value }
    assert_equal 2, NeverBlock.run { pool.spawn { 2 }.value }
  end

  def test_idle_fibers_are_retired_when_the_loop_closes
    pool = NeverBlock::FiberPool.new(size: 3)
    fibers = NeverBlock.run { 3.times.map { pool.spawn { sleep 0.01; Fiber.current } }.map(&:value) }
    assert fibers.none?(&:alive?)
  end

  def test_a_pool_is_bound_to_one_loop_at_a_time
    pool = NeverBlock::FiberPool.new(size: 1)
    NeverBlock.run do
      pool.spawn { 1 }.wait
      error = assert_raises(NeverBlock::Error) { Thread.new { Thread.current.report_on_exception = false; NeverBlock.run { pool.spawn { 2 } } }.value }
      assert_match(/another event loop/, error.message)
    end
  end
end

# Fiber storage (Ruby 3.2+) in pooled fibers behaves as in new fibers.
class FiberPoolStorageTest < NeverBlockTest
  def setup
    skip "Fiber storage needs Ruby 3.2" if RUBY_VERSION < "3.2"
  end

  def test_a_pooled_block_sees_the_spawners_storage
    pool = NeverBlock::FiberPool.new(size: 1)
    Fiber[:request_id] = "r-1"
    assert_equal "r-1", pool.spawn { Fiber[:request_id] }.value
    Fiber[:request_id] = "r-2"
    assert_equal "r-2", pool.spawn { Fiber[:request_id] }.value
  ensure
    Fiber[:request_id] = nil
  end

  def test_storage_set_by_one_block_does_not_leak_into_the_next
    pool = NeverBlock::FiberPool.new(size: 1)
    pool.spawn { Fiber[:user] = "alice" }.wait
    assert_nil pool.spawn { Fiber[:user] }.value
  end
end
