# frozen_string_literal: true

require "test_helper"
require "objspace"

# The task tree (NeverBlock::Task::Tree): what a task spawns is its child,
# cancelled when the task fails, is cancelled or times out; handed up when
# it returns; left alone when spawned detached.
class TaskTreeTest < NeverBlockTest
  def test_a_timeout_that_fires_cancels_the_task_spawned_inside_its_block
    child = nil
    cleaned = false
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.2) do
        child = NeverBlock.spawn do
          sleep 1
          flunk "the child ran past its parent's timeout"
        ensure
          cleaned = true
        end
        child.wait
      end
    end
    # Cancelled before the timeout's error reached here, its ensure done.
    assert_equal :cancelled, child.status
    assert cleaned
    assert_match(/timed out/, child.error.message)
  end

  def test_stdlib_timeout_cancels_what_its_block_spawned_too
    child = nil
    assert_raises(Timeout::Error) do
      Timeout.timeout(0.1) do
        child = NeverBlock.spawn { sleep 5 }
        sleep 5
      end
    end
    assert_equal :cancelled, child.status
  end

  def test_a_timeout_cancels_only_what_was_spawned_inside_its_block
    before = NeverBlock.spawn { sleep 0.3 }
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.05) do
        NeverBlock.spawn { sleep 5 }
        sleep 5
      end
    end
    assert_equal :running, before.status
    assert_equal :completed, before.wait.status
  end

  def test_a_timeout_that_does_not_fire_leaves_the_children_running
    child = NeverBlock.timeout(1) { NeverBlock.spawn { sleep 0.05; :done } }
    assert_equal :running, child.status
    assert_equal :done, child.value
  end

  def test_a_task_that_raises_cancels_its_children_before_it_ends
    children = []
    cleaned = []
    parent = NeverBlock.spawn do
      2.times do |index|
        children << NeverBlock.spawn do
          sleep 10
        ensure
          cleaned << index
        end
      end
      sleep 0.01
      raise ArgumentError, "boom"
    end
    error = assert_raises(ArgumentError) { parent.value }
    assert_equal "boom", error.message
    assert_equal %i[cancelled cancelled], children.map(&:status)
    assert_equal [0, 1], cleaned.sort
    assert_empty parent.children
    assert_match(/its parent .* failed/, children.first.error.message)
  end

  def test_cancel_reaches_two_levels_down
    grandchild = nil
    parent = NeverBlock.spawn do
      NeverBlock.spawn do
        grandchild = NeverBlock.spawn { sleep 10 }
        sleep 10
      end
      sleep 10
    end
    sleep 0.01
    assert_equal :running, grandchild.status
    parent.cancel
    parent.wait
    assert_equal :cancelled, parent.status
    assert_equal :cancelled, grandchild.status
  end

  def test_the_children_of_a_task_that_returned_go_up_to_its_parent
    grandchild = nil
    middle = nil
    parent = NeverBlock.spawn do
      middle = NeverBlock.spawn do
        grandchild = NeverBlock.spawn { sleep 10 }
        :returned
      end
      sleep 10
    end
    sleep 0.01 until middle
    assert_equal :returned, middle.value
    assert_same parent, grandchild.parent
    assert_equal [grandchild], parent.children
    parent.cancel.wait
    assert_equal :cancelled, grandchild.status
  end

  def test_a_detached_task_outlives_the_task_that_spawned_it
    detached = nil
    parent = NeverBlock.spawn do
      detached = NeverBlock.spawn(detached: true) { sleep 0.1; :still_here }
      raise "parent failed"
    end
    assert_raises(RuntimeError) { parent.value }
    assert_nil detached.parent
    assert_equal :running, detached.status
    assert_equal :still_here, detached.value
  end

  # The first frame outside NeverBlock: the app's line, not NeverBlock.spawn
  # or FiberPool#spawn; a task spawned otherwise records none (its block's
  # location is in #inspect).
  def test_a_detached_task_records_where_the_app_spawned_it
    pool = NeverBlock::FiberPool.new(size: 1)
    spawned = NeverBlock.spawn(detached: true) { :done }
    pooled = pool.spawn(detached: true) { :done }
    through_a_method = spawn_detached_here
    child = NeverBlock.spawn { :done }
    here = __LINE__ - 4
    assert_equal [[__FILE__, here], [__FILE__, here + 1], [__FILE__, DETACHED_HELPER_LINE]],
                 [spawned, pooled, through_a_method].map { |task| [task.spawned_at.path, task.spawned_at.lineno] }
    assert_nil child.spawned_at
    [spawned, pooled, through_a_method, child].each(&:wait)
  ensure
    pool&.shutdown
  end

  DETACHED_HELPER_LINE = __LINE__ + 1
  def spawn_detached_here = NeverBlock.spawn(detached: true) { :done }

  def test_a_pool_task_is_a_child_too_and_a_queued_one_is_cancelled_unrun
    pool = NeverBlock::FiberPool.new(size: 1)
    ran = []
    running = queued = nil
    parent = NeverBlock.spawn do
      running = pool.spawn { sleep 10 }
      queued = pool.spawn { ran << :queued }
      raise "parent failed"
    end
    assert_raises(RuntimeError) { parent.value }
    assert_equal :cancelled, running.status
    assert_equal :cancelled, queued.status
    assert_empty ran
  ensure
    pool&.shutdown(1)
  end

  def test_a_cancelled_child_finishes_its_cleanup_undisturbed
    steps = []
    parent = NeverBlock.spawn do
      NeverBlock.spawn do
        sleep 10
      ensure
        steps << :cleanup_started
        sleep 0.05 # a pool giving back its connection, say
        steps << :cleanup_done
      end
      sleep 10
    end
    sleep 0.01
    parent.cancel
    parent.cancel # a second cancel while it waits for its child changes nothing
    parent.wait
    assert_equal %i[cleanup_started cleanup_done], steps
  end

  def test_a_child_that_ignores_its_cancel_is_logged_and_detached_after_cancel_timeout
    previous = NeverBlock.cancel_timeout
    NeverBlock.cancel_timeout = 0.2
    stubborn = nil
    log = capture_log do
      parent = NeverBlock.spawn do
        stubborn = NeverBlock.spawn do
          sleep 10
        rescue NeverBlock::Cancelled
          sleep 10 # swallows it and goes on
        end
        raise "parent failed"
      end
      seconds = elapsed { assert_raises(RuntimeError) { parent.value } }
      assert_operator seconds, :<, 3
    end
    assert_match(/still run after 0.2 s.*detached/, log)
    assert_nil stubborn.parent
    assert_equal :running, stubborn.status
  ensure
    NeverBlock.cancel_timeout = previous
    stubborn&.cancel
    stubborn&.wait
  end

  def test_a_long_lived_parent_spawning_many_short_children_stays_flat
    GC.start
    # Tasks other tests left to the GC (or still hold): counted before, so
    # that only this test's are compared (2,070 were alive in one full pass).
    before = ObjectSpace.each_object(NeverBlock::Task).count
    parent = NeverBlock.spawn do
      5_000.times { NeverBlock.spawn { nil } }
      NeverBlock.current_task
    end
    assert_same parent, parent.value
    assert_empty parent.children
    assert_nil parent.instance_variable_get(:@children)&.first
    GC.start
    assert_operator ObjectSpace.each_object(NeverBlock::Task).count - before, :<, 1000, "finished children are still referenced"
    # A child keeps nothing of its parent once it ended either.
    last = NeverBlock.spawn { NeverBlock.spawn { nil } }.value
    assert_nil last.parent
  end

  def test_current_task_is_the_running_task
    assert_same NeverBlock.current_task, NeverBlock.current_task
    task = NeverBlock.spawn { NeverBlock.current_task }
    assert_same task, task.value
  end

  def test_cancel_timeout_rejects_bad_values
    assert_raises(ArgumentError) { NeverBlock.cancel_timeout = -1 }
    assert_raises(ArgumentError) { NeverBlock.cancel_timeout = Float::NAN }
  end
end

# NeverBlock.run's block is the root of its tree.
class TaskTreeRunTest < Minitest::Test
  def test_run_whose_block_raises_does_not_wait_for_its_children
    child = nil
    started = NeverBlock::Clock.now
    assert_raises(ArgumentError) do
      NeverBlock.run do
        child = NeverBlock.spawn { sleep 10 }
        raise ArgumentError, "the block failed"
      end
    end
    assert_operator NeverBlock::Clock.now - started, :<, 5
    assert_equal :cancelled, child.status
  end

  def test_run_still_waits_for_children_of_a_block_that_returned
    child = nil
    value = NeverBlock.run do
      child = NeverBlock.spawn { sleep 0.05; :child_done }
      :block_done
    end
    assert_equal :block_done, value
    assert_equal :child_done, child.value
  end
end
