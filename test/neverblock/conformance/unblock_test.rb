# frozen_string_literal: true

require_relative "conformance_helper"

# Scheduler#unblock called when it should not be, or by a broken scheduler
# (Ruby's BrokenUnblockScheduler and SleepingUnblockScheduler): a stray or
# late unblock must neither crash the loop nor end a wait it was not meant
# for.
class ConformanceUnblockTest < ConformanceTest
  # Its unblock hook raises after doing its job (Ruby's BrokenUnblockScheduler).
  class RaisingUnblockScheduler < NeverBlock::Scheduler
    def unblock(blocker, fiber)
      super
      raise "broken unblock"
    end
  end

  # Its unblock hook sleeps after doing its job (Ruby's SleepingUnblockScheduler).
  class SleepingUnblockScheduler < NeverBlock::Scheduler
    def unblock(blocker, fiber)
      super
      Kernel.sleep(0.05)
    end
  end

  # Ruby's test_broken_unblock: the error belongs to the exiting thread that
  # called unblock, so joining that thread raises it in the joining fiber;
  # the loop itself carries on and ends. The thread ends only when the second
  # fiber lets it, after the join has begun to wait: a thread that ended
  # before the join would call no unblock at all.
  def test_an_unblock_hook_that_raises_fails_the_join_not_the_loop
    error = nil
    other_fiber_finished = false
    release = Thread::Queue.new
    on_scheduler_thread(scheduler_class: RaisingUnblockScheduler) do
      schedule do
        Thread.new do
          Thread.current.report_on_exception = false
          release.pop
        end.join
      rescue RuntimeError => e
        error = e
      end
      schedule do
        sleep 0.01
        release << :go
        other_fiber_finished = true
      end
    end
    assert_equal "broken unblock", error&.message
    assert other_fiber_finished
  end

  # Ruby's test_thread_join_hang.
  def test_an_unblock_hook_that_sleeps_does_not_hang_the_join
    result = nil
    on_scheduler_thread(scheduler_class: SleepingUnblockScheduler) do
      schedule do
        result = Thread.new do
          Kernel.sleep(0.01)
          :joined
        end.value
      end
    end
    assert_equal :joined, result
  end

  def test_unblocking_a_fiber_that_waits_for_io_does_not_end_its_read
    reader, writer = IO.pipe
    events = []
    on_scheduler_thread do
      scheduler = Fiber.scheduler
      waiting = schedule { events << [:read, reader.read(5)] }
      schedule do
        scheduler.unblock(:stray, waiting)                       # from the loop's thread
        Thread.new { scheduler.unblock(:stray, waiting) }.join   # and from another
        sleep 0.02
        events << :writing
        writer.write("hello")
      end
    end
    assert_equal [:writing, [:read, "hello"]], events
  ensure
    reader&.close
    writer&.close
  end

  def test_unblocking_a_finished_fiber_is_ignored
    finished = nil
    after = false
    on_scheduler_thread do
      scheduler = Fiber.scheduler
      finished = schedule { :done }
      schedule do
        scheduler.unblock(:stray, finished)
        Thread.new { scheduler.unblock(:stray, finished) }.join
        sleep 0.01
        after = true
      end
    end
    refute_predicate finished, :alive?
    assert after
  end

  def test_unblocking_a_fiber_waiting_on_a_task_does_not_end_the_wait
    result = nil
    NeverBlock.run do
      task = NeverBlock.spawn do
        sleep 0.05
        :task_value
      end
      waiter = NeverBlock.spawn { result = task.value }
      sleep 0.01 # both are waiting now
      scheduler = Fiber.scheduler
      scheduler.unblock(:stray, waiter.fiber)
      Thread.new { scheduler.unblock(:stray, waiter.fiber) }.join
      waiter.wait
    end
    assert_equal :task_value, result
  end

  # A thread pushes just as a fiber's Queue#pop(timeout:) expires, so the
  # thread's unblock can arrive after the fiber has left that wait. Whatever
  # it lands on next must not end early: here a Thread#value, which on Ruby
  # 3.2+ returns nil if its wait is cut short.
  def test_an_unblock_racing_a_timeout_does_not_end_a_later_wait
    requires_ruby "3.2", "Queue#pop(timeout:) is new in Ruby 3.2"
    queue = Thread::Queue.new
    rounds = 40
    popped = 0
    values = []
    on_scheduler_thread(limit: 10) do
      schedule do
        rounds.times do |round|
          pusher = Thread.new do
            Kernel.sleep(0.001 * (round % 4))
            queue << round
          end
          popped += 1 if queue.pop(timeout: 0.002)
          values << Thread.new { :right_value }.value
          pusher.join
        end
      end
    end
    assert_equal [:right_value] * rounds, values
    assert_equal rounds, popped + queue.size, "an item was lost"
  end
end
