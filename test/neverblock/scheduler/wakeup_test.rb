# frozen_string_literal: true

require "test_helper"

# Wake-ups that must neither be lost nor land on the wrong wait
# (lib/neverblock/scheduler/wakeup.rb and the blocking hooks).
class SchedulerWakeupTest < NeverBlockTest
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

  # Another thread pushes while the watcher fiber is about to read the
  # pipe: the byte it writes is read with the one before it. The pending
  # flag must not stay set with the pipe empty, or no later push would write
  # a byte and the loop would sleep through every wake-up after it (seen as
  # a pool's PoolTimeout with threads and loops together on the select
  # selector). A TracePoint makes the race happen every time.
  def test_a_push_racing_the_watchers_read_leaves_later_pushes_waking_the_loop
    reader = Fiber.scheduler.instance_variable_get(:@wakeup).instance_variable_get(:@reader)
    sleeper = NeverBlock.spawn { sleep 30 } # the loop blocks in the selector for up to 30 s
    first = Thread::Queue.new
    racing = Thread::Queue.new
    later = Thread::Queue.new
    waiters = [first, racing].map { |queue| NeverBlock.spawn { queue.pop } }
    raced = false
    race = TracePoint.new(:call, :c_call) do |tp|
      next if raced || tp.method_id != :read_nonblock || !tp.self.equal?(reader)

      raced = true
      pusher = Thread.new { racing << :raced } # its wake-up lands while the watcher reads
      Thread.pass while pusher.alive? # the GVL only: no scheduler hook from inside the hook
    end
    race.enable
    Thread.new { first << :first }.join
    assert_equal %i[first raced], waiters.map(&:value)
    race.disable
    assert raced, "the watcher read its pipe"
    waiter = NeverBlock.spawn { later.pop }
    pusher = Thread.new { sleep 0.1; later << :later } # once the loop waits in the selector again
    assert_operator elapsed { assert_equal :later, waiter.value }, :<, 5
    pusher.join
  ensure
    race&.disable
    sleeper&.cancel
  end

  def test_cancel_from_another_thread_returns_the_task
    task = NeverBlock.spawn { sleep 10 }
    assert_same task, Thread.new { task.cancel }.value
    assert_raises(NeverBlock::Cancelled) { task.value }
  end
end
