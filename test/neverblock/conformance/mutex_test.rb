# frozen_string_literal: true

require_relative "conformance_helper"

# Thread::Mutex and Thread::ConditionVariable in scheduled fibers: waiting
# suspends only the fiber (Scheduler#block / #kernel_sleep), and a release
# from another fiber or another thread wakes it (Scheduler#unblock).
class ConformanceMutexTest < ConformanceTest
  def test_synchronize_in_a_scheduled_fiber_keeps_the_fiber_non_blocking
    states = []
    mutex = Thread::Mutex.new
    on_scheduler_thread do
      schedule do
        states << Fiber.current.blocking?
        mutex.synchronize { states << Fiber.current.blocking? << mutex.owned? }
      end
    end
    assert_equal [false, false, true], states
    refute mutex.locked?
  end

  def test_two_fibers_take_the_lock_in_turn
    mutex = Thread::Mutex.new
    events = []
    on_scheduler_thread do
      %i[a b].each do |name|
        schedule do
          mutex.lock
          events << [name, :locked]
          sleep 0.05 # suspends the holder; the other fiber must keep waiting
          events << [name, :unlocking]
          mutex.unlock
        end
      end
    end
    assert_equal [%i[a locked], %i[a unlocking], %i[b locked], %i[b unlocking]], events
  end

  def test_a_fiber_waits_for_a_mutex_held_by_another_thread_without_blocking_the_loop
    mutex = Thread::Mutex.new
    other_fiber_ran = Thread::Queue.new
    events = []
    mutex.lock
    begin
      waiter = Thread.new do
        on_scheduler_thread do
          schedule do
            mutex.synchronize { events << :locked }
          end
          schedule do
            events << :other_fiber_ran
            other_fiber_ran << true
          end
        end
      end
      other_fiber_ran.pop # the first fiber was already waiting when the second started
      events << :released
    ensure
      mutex.unlock
    end
    waiter.join
    assert_equal %i[other_fiber_ran released locked], events
  end

  def test_fibers_on_two_threads_share_one_mutex
    mutex = Thread::Mutex.new
    holders = 0
    overlaps = 0
    count = 0
    threads = 2.times.map do
      Thread.new do
        on_scheduler_thread do
          5.times do
            schedule do
              20.times do
                mutex.synchronize do
                  holders += 1
                  overlaps += 1 if holders > 1
                  sleep 0 # give every other fiber and thread a chance to cut in
                  count += 1
                  holders -= 1
                end
              end
            end
          end
        end
      end
    end
    threads.each(&:join)
    assert_equal 200, count
    assert_equal 0, overlaps
  end

  def test_locking_a_mutex_the_fiber_already_holds_raises_thread_error
    error = nil
    on_scheduler_thread do
      schedule do
        mutex = Thread::Mutex.new
        mutex.synchronize { mutex.lock }
      rescue ThreadError => e
        error = e
      end
    end
    assert_match(/recursive locking/, error&.message)
  end

  # Ruby's test_mutex_fiber_raise: Fiber#raise from another scheduled fiber
  # ends the wait for the lock with that exception.
  def test_raising_into_a_fiber_waiting_for_a_mutex_ends_its_wait
    mutex = Thread::Mutex.new
    error = nil
    mutex.lock
    begin
      on_scheduler_thread(limit: 3) do
        waiter = schedule do
          mutex.lock
        rescue RuntimeError => e
          error = e
        end
        schedule { waiter.raise("bye") }
      end
    ensure
      mutex.unlock
    end
    assert_equal "bye", error&.message
  end

  # Ruby's test_mutex_deadlock: the thread's blocking root fiber locks a mutex
  # that a scheduled fiber holds while it waits forever; Ruby must see that
  # nothing can ever make progress.
  def test_a_lock_that_can_never_be_released_is_reported_as_a_deadlock
    out, err, status = run_script(<<~RUBY)
      require "neverblock"
      mutex = Thread::Mutex.new
      Thread.new do
        Fiber.set_scheduler(NeverBlock::Scheduler.new)
        Fiber.schedule do
          mutex.synchronize do
            puts "in synchronize"
            Thread::Queue.new.pop # nobody will ever push
          end
        end
        mutex.lock
      end.join
    RUBY
    assert_equal "in synchronize\n", out
    assert_match(/No live threads left\. Deadlock\?|lock already owned by another fiber/, err)
    refute_predicate status, :success?
  end

  def test_fibers_of_one_loop_waiting_on_each_other_are_reported_as_a_deadlock
    _out, err, status = run_script(<<~RUBY)
      require "neverblock"
      mutex = Thread::Mutex.new
      NeverBlock.run do
        NeverBlock.spawn { mutex.synchronize { Thread::Queue.new.pop } }
        NeverBlock.spawn { mutex.lock }
      end
    RUBY
    assert_match(/No live threads left\. Deadlock\?/, err)
    refute_predicate status, :success?
  end

  # --- ConditionVariable --------------------------------------------------

  def test_signal_wakes_a_fiber_waiting_on_a_condition_variable
    mutex = Thread::Mutex.new
    condition = Thread::ConditionVariable.new
    pending = 0
    received = 0
    on_scheduler_thread do
      schedule do
        mutex.synchronize do
          3.times do
            condition.wait(mutex) while pending.zero?
            pending -= 1
            received += 1
          end
        end
      end
      schedule do
        3.times do
          mutex.synchronize do
            pending += 1
            condition.signal
          end
          sleep 0.01
        end
      end
    end
    assert_equal 3, received
  end

  def test_broadcast_wakes_every_fiber_waiting_on_a_condition_variable
    mutex = Thread::Mutex.new
    condition = Thread::ConditionVariable.new
    waiting = Thread::Queue.new
    go = false
    woken = []
    on_scheduler_thread do
      5.times do |index|
        schedule do
          mutex.synchronize do
            waiting << index
            condition.wait(mutex) until go
            woken << index
          end
        end
      end
      schedule do
        5.times { waiting.pop }
        mutex.synchronize do
          go = true
          condition.broadcast
        end
      end
    end
    assert_equal [0, 1, 2, 3, 4], woken.sort
  end

  def test_waiting_on_a_condition_variable_with_a_timeout_gives_up_and_relocks
    mutex = Thread::Mutex.new
    condition = Thread::ConditionVariable.new
    waited = nil
    owned_after = nil
    other_fiber_ran_meanwhile = false
    on_scheduler_thread do
      schedule do
        mutex.synchronize do
          waited = elapsed { condition.wait(mutex, 0.05) }
          owned_after = mutex.owned?
        end
      end
      schedule { other_fiber_ran_meanwhile = true }
    end
    assert_operator waited, :>=, 0.04
    assert_operator waited, :<, 1
    assert owned_after
    assert other_fiber_ran_meanwhile
  end

  # A signal from a plain thread: Ruby calls Scheduler#unblock from that
  # thread for a fiber waiting in Mutex#sleep (Scheduler#kernel_sleep).
  def test_a_signal_from_another_thread_wakes_a_waiting_fiber
    mutex = Thread::Mutex.new
    condition = Thread::ConditionVariable.new
    waiting = Thread::Queue.new
    go = false
    woken = false
    signaller = Thread.new do
      waiting.pop
      mutex.synchronize do
        go = true
        condition.signal
      end
    end
    on_scheduler_thread(limit: 3) do
      schedule do
        mutex.synchronize do
          waiting << true
          condition.wait(mutex) until go
          woken = true
        end
      end
    end
    assert woken
  ensure
    signaller&.kill&.join
  end

  # Ruby's test_deadlock (test_scheduler.rb): a thread signals over and over
  # while a fiber waits ten times.
  def test_a_fiber_keeps_receiving_signals_from_a_busy_signalling_thread
    mutex = Thread::Mutex.new
    condition = Thread::ConditionVariable.new
    stop = false
    signaller = Thread.new do
      until stop
        mutex.synchronize { condition.signal }
        Kernel.sleep(0.0005)
      end
    end
    rounds = 0
    on_scheduler_thread(limit: 3) do
      schedule do
        10.times do
          mutex.synchronize do
            condition.wait(mutex)
            rounds += 1
          end
        end
      end
    end
    assert_equal 10, rounds
  ensure
    stop = true
    signaller&.join
  end

  # Ruby's test_condition_variable (test_scheduler.rb): Fiber#raise from the
  # thread's root fiber ends a condition-variable wait with that exception.
  def test_raising_into_a_fiber_waiting_on_a_condition_variable_ends_its_wait
    requires_ruby "3.2", "Ruby 3.1's Mutex#sleep does not re-lock the mutex when the scheduler's " \
                         "kernel_sleep raises, so synchronize then fails with ThreadError (Ruby's " \
                         "reference scheduler shows the same)"
    mutex = Thread::Mutex.new
    condition = Thread::ConditionVariable.new
    error = nil
    on_scheduler_thread do
      waiter = schedule do
        mutex.synchronize { condition.wait(mutex) }
      rescue StandardError => e
        error = e
      end
      waiter.raise(RuntimeError, "stop waiting")
    end
    assert_instance_of RuntimeError, error
    assert_equal "stop waiting", error.message
    refute mutex.locked?
  end
end
