# frozen_string_literal: true

require "test_helper"

# NeverBlock::Task: value, wait, cancel, alive?, status.
class TaskTest < NeverBlockTest
  def test_value_returns_the_block_result
    assert_equal 3, NeverBlock.spawn { 1 + 2 }.value
  end

  def test_value_reraises_the_task_exception
    task = NeverBlock.spawn { raise ArgumentError, "bad" }
    error = assert_raises(ArgumentError) { task.value }
    assert_equal "bad", error.message
    assert_equal :failed, task.status
    assert_same error, task.error
  end

  def test_a_spawned_task_runs_at_once_until_its_first_wait
    order = []
    task = NeverBlock.spawn do
      order << :task_started
      sleep 0.01
      order << :task_finished
    end
    order << :spawner
    assert_equal :running, task.status
    task.wait
    assert_equal %i[task_started spawner task_finished], order
  end

  def test_a_task_spawned_from_the_loop_fiber_starts_on_the_next_turn
    scheduler = Fiber.scheduler
    order = []
    task = nil
    # Timers run on the loop fiber itself, outside any task.
    scheduler.instance_variable_get(:@timers).after(0) { task = scheduler.spawn { order << :task } }
    sleep 0.01 until task
    task.wait
    assert_equal [:task], order
  end

  def test_status_moves_from_running_to_completed
    task = NeverBlock.spawn { sleep 0.05 }
    assert_equal :running, task.status
    assert task.alive?
    task.wait
    assert_equal :completed, task.status
    refute task.alive?
    assert task.finished?
  end

  def test_wait_returns_the_task_and_does_not_raise
    log = capture_log do
      task = NeverBlock.spawn { raise "ignored by wait" }
      assert_same task, task.wait
      assert_equal :failed, task.status
      sleep 0.01 # the loop goes idle: a failure nobody collected is logged
    end
    assert_match(/unhandled RuntimeError.*ignored by wait/, log)
  end

  def test_many_fibers_can_wait_on_one_task
    task = NeverBlock.spawn { sleep 0.05; :done }
    waiters = 5.times.map { NeverBlock.spawn { task.value } }
    assert_equal [:done] * 5, waiters.map(&:value)
  end

  def test_a_task_cannot_wait_for_itself
    task = nil
    task = NeverBlock.spawn do
      sleep 0 # spawn returns at the first wait; then `task` is assigned
      task.wait
    end
    error = assert_raises(NeverBlock::Error) { task.value }
    assert_match(/itself/, error.message)
  end

  def test_cancel_raises_cancelled_inside_the_task_and_runs_ensure
    events = []
    sleeping = Latch.new
    task = NeverBlock.spawn do
      sleeping.count_down
      sleep 10
    ensure
      events << :ensure
    end
    sleeping.wait
    task.cancel
    assert_raises(NeverBlock::Cancelled) { task.value }
    assert_equal [:ensure], events
    assert_equal :cancelled, task.status
    assert task.cancelled?
  end

  def test_cancel_interrupts_a_task_waiting_on_io
    reader, writer = IO.pipe
    task = NeverBlock.spawn { reader.read(1) }
    sleep 0.01
    task.cancel
    assert_raises(NeverBlock::Cancelled) { task.value }
    # the selector forgot the cancelled wait: the pipe works normally after
    writer.write("x")
    assert_equal "x", reader.read(1)
  ensure
    reader&.close
    writer&.close
  end

  def test_cancel_a_pending_task_never_runs_its_block
    pool = NeverBlock::FiberPool.new(size: 1)
    blocker = pool.spawn { sleep 0.02 }
    ran = false
    task = pool.spawn { ran = true }
    assert_equal :pending, task.status
    task.cancel
    assert_equal :cancelled, task.status
    blocker.wait
    refute ran
    assert_raises(NeverBlock::Cancelled) { task.value }
  end

  def test_cancelling_a_finished_task_does_nothing
    task = NeverBlock.spawn { :ok }
    task.wait
    assert_same task, task.cancel
    assert_equal :completed, task.status
    assert_equal :ok, task.value
  end

  def test_a_task_cancelling_itself_stops_at_once
    reached = false
    task = nil
    task = NeverBlock.spawn do
      sleep 0
      task.cancel
      reached = true
    end
    assert_raises(NeverBlock::Cancelled) { task.value }
    refute reached
  end

  def test_a_task_that_rescues_cancelled_can_clean_up_and_wait
    sleeping = Latch.new
    task = NeverBlock.spawn do
      sleeping.count_down
      sleep 10
    rescue NeverBlock::Cancelled
      sleep 0.01 # cleanup may still wait
      :cleaned_up
    end
    sleeping.wait
    task.cancel
    assert_equal :cleaned_up, task.value
    assert_equal :completed, task.status
  end

  def test_cancel_wakes_the_waiters_of_the_task
    task = NeverBlock.spawn { sleep 10 }
    waiting = Latch.new
    waiter = NeverBlock.spawn { waiting.count_down; task.value }
    waiting.wait
    task.cancel
    assert_raises(NeverBlock::Cancelled) { waiter.value }
  end

  def test_cancel_from_another_thread
    sleeping = Latch.new
    task = NeverBlock.spawn { sleeping.count_down; sleep 10 }
    sleeping.wait
    Thread.new { task.cancel }.join
    assert_raises(NeverBlock::Cancelled) { task.value }
  end

  def test_value_from_another_thread_blocks_that_thread_until_done
    task = NeverBlock.spawn { sleep 0.05; :from_loop }
    thread = Thread.new { task.value }
    assert_equal :from_loop, thread.value
  end

  def test_a_cancelled_error_raised_by_user_code_is_a_failure_not_a_cancellation
    task = NeverBlock.spawn { raise NeverBlock::Cancelled, "mine" }
    task.wait
    assert_equal :failed, task.status
    assert_raises(NeverBlock::Cancelled) { task.value }
  end

  def test_inspect_names_the_status_and_where_it_was_spawned
    task = NeverBlock.spawn { sleep 0.01 }
    assert_match(/Task.*running.*task_test\.rb:\d+/, task.inspect)
    task.wait
  end

  def test_inspect_shows_the_label_of_the_work_the_task_runs
    task = NeverBlock.spawn { sleep 0.01 }
    task.label = "Solid Queue job 42 (ReportJob)"
    assert_match(/Task.*running Solid Queue job 42 \(ReportJob\) \(.*task_test\.rb:\d+\)/, task.inspect)
    task.wait
  end

  def test_wait_all_returns_values_in_order
    tasks = [0.03, 0.01, 0.02].map { |delay| NeverBlock.spawn { sleep delay; delay } }
    assert_equal [0.03, 0.01, 0.02], NeverBlock.wait_all(tasks)
  end

  def test_wait_all_refuses_what_is_not_a_task_and_waits_for_nothing
    task = NeverBlock.spawn { sleep 0.01; :done }
    error = assert_raises(ArgumentError) { NeverBlock.wait_all([task, 1]) }
    assert_equal "NeverBlock.wait_all takes tasks (what NeverBlock.spawn and Group#spawn return), got 1 (Integer) " \
                 "at index 1; to run blocks and wait for their values, use NeverBlock.group or NeverBlock.map",
                 error.message
    refute task.observed?, "no task was marked as collected by a wait_all that refused its list"
    not_a_list = assert_raises(ArgumentError) { NeverBlock.wait_all(task) }
    assert_match(/takes a list of tasks, got #<NeverBlock::Task/, not_a_list.message)
    assert_equal [:done], NeverBlock.wait_all([task])
  end

  def test_wait_all_raises_the_first_failure_after_all_finished
    finished = []
    tasks = [
      NeverBlock.spawn { sleep 0.02; finished << 0 },
      NeverBlock.spawn { raise IndexError, "first" },
      NeverBlock.spawn { raise KeyError, "second" },
      NeverBlock.spawn { sleep 0.05; finished << 3 }
    ]
    error = assert_raises(IndexError) { capture_log { NeverBlock.wait_all(tasks) } }
    assert_equal "first", error.message
    assert_equal [0, 3], finished
  end
end
