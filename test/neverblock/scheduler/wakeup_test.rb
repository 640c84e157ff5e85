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

  def test_cancel_from_another_thread_returns_the_task
    task = NeverBlock.spawn { sleep 10 }
    assert_same task, Thread.new { task.cancel }.value
    assert_raises(NeverBlock::Cancelled) { task.value }
  end
end
