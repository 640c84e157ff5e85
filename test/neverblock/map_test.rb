# frozen_string_literal: true

require "test_helper"

# NeverBlock.map: bounded concurrency, results in input order.
class MapTest < NeverBlockTest
  def test_results_come_back_in_input_order
    assert_equal [30, 10, 20], NeverBlock.map([3, 1, 2], concurrency: 3) { |x| sleep x * 0.01; x * 10 }
  end

  def test_at_most_concurrency_blocks_run_at_once
    running = 0
    peak = 0
    NeverBlock.map(1..20, concurrency: 4) do
      running += 1
      peak = [peak, running].max
      sleep 0.01
      running -= 1
    end
    assert_equal 4, peak
  end

  def test_blocks_overlap
    time = elapsed { NeverBlock.map(1..10, concurrency: 10) { sleep 0.2 } }
    assert_operator time, :<, 1
  end

  def test_the_enumerable_is_consumed_lazily
    pulled = 0
    source = Enumerator.new { |y| 100.times { |i| pulled += 1; y << i } }
    first = nil
    NeverBlock.map(source, concurrency: 2) do |x|
      first ||= pulled
      x
    end
    assert_operator first, :<=, 3, "only about `concurrency` items are pulled before work starts"
  end

  def test_a_failure_cancels_the_rest_and_raises_the_first_error
    cancelled = 0
    five_started = Latch.new(5)
    error = assert_raises(KeyError) do
      NeverBlock.map(1..10, concurrency: 5) do |x|
        five_started.count_down
        five_started.wait
        raise KeyError, "item #{x}" if x == 2

        sleep 1
      rescue NeverBlock::Cancelled
        cancelled += 1
        raise
      end
    end
    assert_equal "item 2", error.message
    assert_equal 4, cancelled
  end

  # A crawler that keeps what it fetched: every item is mapped, and the
  # failures come together at the end, each with its item and index.
  def test_without_fail_fast_every_item_is_mapped_and_each_failure_names_its_item
    mapped = []
    error = assert_raises(NeverBlock::GroupError) do
      NeverBlock.map(%w[/a /b /c /d /e], concurrency: 2, fail_fast: false) do |path|
        sleep 0.01
        raise IOError, "#{path}: connection reset" if %w[/b /d].include?(path)

        mapped << path
        "page #{path}"
      end
    end
    assert_equal %w[/a /c /e], mapped.sort
    assert_equal ["page /a", nil, "page /c", nil, "page /e"], error.values
    assert_equal [["/b", 1], ["/d", 3]], error.failures.map { |failure| [failure.item, failure.index] }.sort
    assert_match(%r{task 1 \(item "/b"\): IOError: /b: connection reset}, error.message)
  end

  def test_without_fail_fast_and_no_failure_it_is_a_plain_map
    assert_equal [2, 4, 6], NeverBlock.map([1, 2, 3], fail_fast: false) { |x| x * 2 }
  end

  def test_empty_input
    assert_equal [], NeverBlock.map([]) { |x| x }
  end

  def test_concurrency_is_validated
    [0, -1, 1.5, nil].each do |bad|
      assert_raises(ArgumentError, bad.inspect) { NeverBlock.map([1], concurrency: bad) { |x| x } }
    end
  end

  def test_cancelling_the_caller_cancels_its_blocks
    cleaned = 0
    started = 0
    caller = NeverBlock.spawn do
      NeverBlock.map(1..3, concurrency: 3) do
        started += 1
        sleep 5
      ensure
        cleaned += 1
      end
    end
    sleep 0.01 until started == 3 # a loaded machine may take more than a turn to start them
    caller.cancel
    assert_raises(NeverBlock::Cancelled) { caller.value }
    assert_equal 3, cleaned
  end
end

# map outside a loop starts one.
class MapOutsideLoopTest < PlainTest
  def test_map_outside_a_loop_runs_its_own
    time = elapsed { assert_equal [1, 2, 3, 4], NeverBlock.map([1, 2, 3, 4]) { |x| sleep 0.5; x } }
    assert_operator time, :<, 1.5 # one at a time: 2 s
    assert_nil Fiber.scheduler
  end

  def test_fail_fast_false_outside_a_loop
    error = assert_raises(NeverBlock::GroupError) do
      NeverBlock.map([1, 2], fail_fast: false) { |x| x == 2 ? raise("no #{x}") : x }
    end
    assert_equal [1, nil], error.values
  end
end
