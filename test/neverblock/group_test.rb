# frozen_string_literal: true

require "test_helper"

# NeverBlock.group, NeverBlock.race, NeverBlock::Group and NeverBlock::Semaphore.
class GroupTest < NeverBlockTest
  def test_group_returns_every_value_in_spawn_order
    values = NeverBlock.group do |group|
      group.spawn { sleep 0.03; :slow }
      group.spawn { :at_once }
      group.spawn { sleep 0.01; nil }
    end
    assert_equal [:slow, :at_once, nil], values
  end

  def test_the_first_failure_cancels_the_others_at_once_and_is_raised
    cleaned = false
    other = nil
    started = now
    error = assert_raises(ArgumentError) do
      NeverBlock.group do |group|
        other = group.spawn do
          sleep 10
        ensure
          cleaned = true
        end
        group.spawn { sleep 0.02; raise ArgumentError, "bad input" }
      end
    end
    assert_equal "bad input", error.message
    assert_operator now - started, :<, 5
    assert_equal :cancelled, other.status
    assert cleaned
  end

  def test_every_failure_is_reachable_on_the_group_with_its_task_and_item
    group = NeverBlock::Group.new(fail_fast: false)
    one = group.spawn("https://a.example/") { raise ArgumentError, "one" }
    two = group.spawn { sleep 0.01; raise KeyError, "two" }
    group.spawn { :fine }
    assert_raises(NeverBlock::GroupError) { group.wait }
    assert_equal %w[one two], group.errors.map(&:message)
    assert_equal [[one, 0, "https://a.example/"], [two, 1, nil]], group.failures.map { |f| [f.task, f.index, f.item] }
  end

  # fail_fast: false waits for every task, however many fail before it
  # ends, then raises every failure together, with the values of the rest.
  def test_without_fail_fast_every_task_runs_and_the_failures_are_raised_together
    finished = []
    error = assert_raises(NeverBlock::GroupError) do
      NeverBlock.group(fail_fast: false) do |group|
        group.spawn { raise ArgumentError, "bad input" }
        group.spawn { sleep 0.02; finished << 1; :one }
        group.spawn { sleep 0.01; raise KeyError, "no such key" }
        group.spawn { sleep 0.03; finished << 3; :three }
      end
    end
    assert_equal [1, 3], finished
    assert_equal [nil, :one, nil, :three], error.values
    assert_equal [[ArgumentError, 0], [KeyError, 2]], error.failures.map { |f| [f.error.class, f.index] }
    assert_kind_of NeverBlock::Error, error
    assert_kind_of ArgumentError, error.cause
    assert_equal "2 of 4 tasks failed: task 0: ArgumentError: bad input; task 2: KeyError: no such key " \
                 "(rescue NeverBlock::GroupError for #failures, each error with its task and item, and #values)",
                 error.message
  end

  def test_without_fail_fast_and_no_failure_the_values_come_back
    values = NeverBlock.group(fail_fast: false) { |group| 3.times { |index| group.spawn { sleep 0.01; index } } }
    assert_equal [0, 1, 2], values
  end

  def test_a_group_error_names_the_first_failures_and_counts_the_rest
    error = assert_raises(NeverBlock::GroupError) do
      NeverBlock.group(fail_fast: false) { |group| 5.times { |index| group.spawn(index) { raise "no #{index}" } } }
    end
    assert_match(/\A5 of 5 tasks failed: task 0 \(item 0\): RuntimeError: no 0; task 1 .*; task 2 .*no 2; and 2 more /,
                 error.message)
    assert_equal 5, error.failures.size
  end

  def test_a_fail_fast_that_is_not_a_boolean_is_refused
    error = assert_raises(ArgumentError) { NeverBlock::Group.new(fail_fast: nil) }
    assert_match(/fail_fast must be true .* or false .*, got nil/, error.message)
    assert_raises(ArgumentError) { NeverBlock.group(fail_fast: "no") { |_group| nil } }
  end

  def test_a_group_whose_block_raises_cancels_its_tasks
    task = nil
    assert_raises(RuntimeError) do
      NeverBlock.group do |group|
        task = group.spawn { sleep 10 }
        raise "the block failed"
      end
    end
    assert_equal :cancelled, task.status
  end

  def test_a_group_under_a_timeout_that_fires_leaves_nothing_running
    task = nil
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.05) do
        NeverBlock.group { |group| task = group.spawn { sleep 10 } }
      end
    end
    assert_equal :cancelled, task.status
  end

  def test_a_limit_bounds_how_many_run_at_once
    running = 0
    most = 0
    values = NeverBlock.group(limit: 3) do |group|
      10.times do |index|
        group.spawn do
          running += 1
          most = [most, running].max
          sleep 0.01
          index
        ensure
          running -= 1
        end
      end
    end
    assert_equal (0...10).to_a, values
    assert_equal 3, most
  end

  def test_nothing_starts_after_the_group_failed
    started = []
    assert_raises(RuntimeError) do
      NeverBlock.group(limit: 1) do |group|
        group.spawn { raise "first" }
        5.times { |index| group.spawn { started << index } }
      end
    end
    assert_empty started
  end

  def test_race_returns_the_first_value_and_cancels_the_rest
    slow = nil
    value = NeverBlock.race do |group|
      slow = group.spawn { sleep 10; :slow }
      group.spawn { sleep 0.02; :fast }
    end
    assert_equal :fast, value
    assert_equal :cancelled, slow.status
  end

  def test_race_skips_failures_while_one_can_still_win
    value = NeverBlock.race do |group|
      group.spawn { raise "a replica is down" }
      group.spawn { sleep 0.02; :replica_two }
    end
    assert_equal :replica_two, value
  end

  def test_race_raises_the_first_failure_when_all_failed
    error = assert_raises(RuntimeError) do
      NeverBlock.race do |group|
        group.spawn { sleep 0.01; raise "second" }
        group.spawn { raise "first" }
      end
    end
    assert_equal "first", error.message
  end

  def test_race_without_tasks_says_so
    assert_raises(NeverBlock::Error) { NeverBlock.race { |_group| nil } }
  end

  def test_a_group_outside_neverblock_runs_its_own_loop
    values = Thread.new { NeverBlock.group { |group| 2.times { |index| group.spawn { sleep 0.01; index } } } }.value
    assert_equal [0, 1], values
  end

  def test_a_group_made_with_new_and_a_limit
    running = 0
    most = 0
    group = NeverBlock::Group.new(limit: 2)
    6.times { |index| group.spawn { running += 1; most = [most, running].max; sleep 0.01; running -= 1; index } }
    assert_equal (0...6).to_a, group.wait
    assert_equal 2, most
  end

  def test_a_bad_limit_is_refused
    assert_raises(ArgumentError) { NeverBlock::Group.new(limit: 0) }
    assert_raises(ArgumentError) { NeverBlock::Semaphore.new(0) }
  end

  def test_a_semaphore_bounds_holders_across_tasks
    semaphore = NeverBlock::Semaphore.new(2)
    holding = 0
    most = 0
    tasks = Array.new(8) do
      NeverBlock.spawn do
        semaphore.acquire do
          holding += 1
          most = [most, holding].max
          sleep 0.01
        ensure
          holding -= 1
        end
      end
    end
    NeverBlock.wait_all(tasks)
    assert_equal 2, most
    assert_equal 2, semaphore.available
  end

  def test_a_cancelled_waiter_takes_no_place_and_a_failed_holder_gives_its_back
    semaphore = NeverBlock::Semaphore.new(1)
    holder = NeverBlock.spawn { semaphore.acquire { sleep 10 } }
    waiter = NeverBlock.spawn { semaphore.acquire { :never } }
    sleep 0.01
    assert_equal 1, semaphore.waiting
    waiter.cancel.wait
    assert_equal 0, semaphore.waiting
    holder.cancel.wait
    assert_equal 1, semaphore.available
    assert_raises(RuntimeError) { semaphore.acquire { raise "boom" } }
    assert_equal 1, semaphore.available
  end

  def test_a_semaphore_is_shared_with_other_threads
    semaphore = NeverBlock::Semaphore.new(1)
    order = []
    thread = nil
    semaphore.acquire do
      thread = Thread.new { semaphore.acquire { order << :thread } }
      sleep 0.05
      order << :fiber
    end
    thread.join
    assert_equal %i[fiber thread], order
  end
end
