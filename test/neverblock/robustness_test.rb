# frozen_string_literal: true

require "test_helper"

# Wake-ups that must neither be lost nor land on the wrong wait, and bad
# input to the scheduler's hooks.
class WakeUpTest < NeverBlockTest
  def test_wake_ups_from_other_threads_are_never_lost
    sleeper = NeverBlock.spawn { sleep 30 } # the loop blocks in the selector for up to 30 s
    time = elapsed { 300.times { |i| assert_equal i, NeverBlock.defer { i } } }
    assert_operator time, :<, 10, "each thread-pool result must wake the blocked loop at once"
    sleeper.cancel
  end

  def test_a_late_unblock_from_another_thread_does_not_end_a_later_sleep
    queue = Thread::Queue.new
    assert_raises(Timeout::Error) { Timeout.timeout(0.05) { queue.pop } }
    pusher = Thread.new { sleep 0.05; queue.push(:late) } # unblocks a wait that is over
    slept = elapsed { sleep 0.3 }
    pusher.join
    assert_operator slept, :>=, 0.29
  end

  def test_map_wakes_its_caller_only_while_it_waits_for_a_slot
    sleeps = []
    items = Enumerator.new do |yielder|
      3.times do |i|
        sleeps << elapsed { sleep 0.2 } # the caller sleeps here, inside each
        yielder << i
      end
    end
    assert_equal [0, 1, 2], NeverBlock.map(items, concurrency: 2) { |x| x }
    assert(sleeps.all? { |s| s >= 0.19 }, "a finishing block ended a sleep early: #{sleeps.inspect}")
  end

  def test_cancel_from_another_thread_returns_the_task
    task = NeverBlock.spawn { sleep 10 }
    assert_same task, Thread.new { task.cancel }.value
    assert_raises(NeverBlock::Cancelled) { task.value }
  end
end

# Bad input reaching the scheduler through Ruby's own calls.
class HookInputTest < NeverBlockTest
  def test_a_negative_sleep_raises_like_ruby
    error = assert_raises(ArgumentError) { sleep(-1) }
    assert_match(/negative/, error.message)
  end

  def test_a_nan_sleep_raises_argument_error_and_the_loop_goes_on
    assert_raises(ArgumentError) { sleep(Float::NAN) }
    assert_equal :alive, NeverBlock.spawn { sleep 0.01; :alive }.value
  end

  def test_an_infinite_timeout_means_no_timeout
    queue = Thread::Queue.new
    NeverBlock.spawn { sleep 0.02; queue << :item }
    assert_equal :item, Timeout.timeout(Float::INFINITY) { queue.pop }
  end

  def test_post_needs_a_callable
    assert_raises(ArgumentError) { Fiber.scheduler.post }
    assert_raises(ArgumentError) { Fiber.scheduler.post(:not_callable) }
  end

  def test_a_failing_posted_callable_is_logged_and_the_loop_goes_on
    scheduler = Fiber.scheduler
    log = capture_log do
      Thread.new { scheduler.post { raise "posted bug" } }.join
      sleep 0.05
    end
    assert_match(/RuntimeError in a callable posted to the loop: posted bug/, log)
    assert_equal :alive, NeverBlock.spawn { :alive }.value
  end
end

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

# fork inside a task: the child runs detached from the parent's loop.
class ForkTest < PlainTest
  def test_the_child_exit_status_is_its_own
    out, err, status = run_ruby(<<~RUBY)
      require "neverblock"
      NeverBlock.logger = Logger.new($stdout)
      NeverBlock.run do
        exited = Process.wait2(fork { exit 3 }).last.exitstatus
        raised = Process.wait2(fork { raise "child failed" }).last.exitstatus
        pid = fork
        if pid.nil?
          raise "blockless child failed" # ends the forking task in the child
        end
        blockless = Process.wait2(pid).last.exitstatus
        puts [exited, raised, blockless].inspect
      end
    RUBY
    assert status.success?, err
    assert_includes out, "[3, 1, 1]"
    assert_match(/blockless child failed/, out, "the blockless child's failure is logged")
  end
end
