# frozen_string_literal: true

require_relative "conformance_helper"

# Timeout.timeout in scheduled fibers (Scheduler#timeout_after): time is up
# at the fiber's current wait, and only that fiber is affected.
class ConformanceTimeoutTest < ConformanceTest
  class OuterError < Timeout::Error; end
  class InnerError < Timeout::Error; end

  # Ruby's test_timeout_after.
  def test_timeout_interrupts_a_sleep
    error = nil
    waited = nil
    on_scheduler_thread do
      schedule do
        waited = elapsed do
          Timeout.timeout(0.01) { sleep 1 }
        rescue Timeout::Error => e
          error = e
        end
      end
    end
    assert_kind_of Timeout::Error, error
    assert_operator waited, :<, 0.5
  end

  def test_timeout_interrupts_a_sleep_without_a_duration
    error = nil
    on_scheduler_thread do
      schedule do
        Timeout.timeout(0.01) { sleep }
      rescue Timeout::Error => e
        error = e
      end
    end
    assert_kind_of Timeout::Error, error
  end

  def test_timeout_interrupts_a_read_from_a_pipe
    reader, writer = IO.pipe
    error = nil
    on_scheduler_thread do
      schedule do
        Timeout.timeout(0.02) { reader.read(1) }
      rescue Timeout::Error => e
        error = e
      end
    end
    assert_kind_of Timeout::Error, error
    writer.write("y") # the pipe still works after the abandoned wait
    assert_equal "y", reader.read(1)
  ensure
    reader&.close
    writer&.close
  end

  def test_timeout_interrupts_a_queue_pop_and_a_mutex_lock
    queue = Thread::Queue.new
    mutex = Thread::Mutex.new
    errors = []
    mutex.lock
    begin
      on_scheduler_thread do
        schedule do
          Timeout.timeout(0.02) { queue.pop }
        rescue Timeout::Error => e
          errors << e
        end
        schedule do
          Timeout.timeout(0.02) { mutex.lock }
        rescue Timeout::Error => e
          errors << e
        end
      end
    ensure
      mutex.unlock
    end
    assert_equal 2, errors.size
    assert_equal 0, queue.num_waiting
  end

  def test_an_inner_timeout_that_expires_first_raises_its_own_error
    error = nil
    on_scheduler_thread do
      schedule do
        Timeout.timeout(1, OuterError) { Timeout.timeout(0.02, InnerError) { sleep 2 } }
      rescue Timeout::Error => e
        error = e
      end
    end
    assert_instance_of InnerError, error
  end

  def test_an_outer_timeout_that_expires_first_raises_its_own_error
    error = nil
    on_scheduler_thread do
      schedule do
        Timeout.timeout(0.02, OuterError) { Timeout.timeout(1, InnerError) { sleep 2 } }
      rescue Timeout::Error => e
        error = e
      end
    end
    assert_instance_of OuterError, error
  end

  def test_the_message_reaches_the_error
    error = nil
    on_scheduler_thread do
      schedule do
        Timeout.timeout(0.01, Timeout::Error, "took too long") { sleep 1 }
      rescue Timeout::Error => e
        error = e
      end
    end
    assert_equal "took too long", error&.message
  end

  def test_a_block_that_finishes_in_time_returns_its_value_and_is_never_interrupted_later
    result = nil
    later_error = nil
    on_scheduler_thread do
      schedule do
        result = Timeout.timeout(0.02) { :in_time }
        begin
          sleep 0.1 # well past the deadline
        rescue Timeout::Error => e
          later_error = e
        end
      end
    end
    assert_equal :in_time, result
    assert_nil later_error
  end

  def test_a_timeout_in_one_fiber_leaves_the_others_alone
    events = []
    on_scheduler_thread do
      schedule do
        Timeout.timeout(0.02) { sleep 1 }
      rescue Timeout::Error
        events << :timed_out
      end
      schedule do
        sleep 0.1
        events << :other_finished
      end
    end
    assert_equal %i[timed_out other_finished], events
  end

  # Ruby's test_timeout_on_main_fiber: on the thread's blocking root fiber
  # the scheduler is not involved, and Timeout works as usual.
  def test_timeout_on_the_blocking_root_fiber_of_a_scheduler_thread
    result = nil
    current = :unset
    error = nil
    on_scheduler_thread do
      current = Fiber.current_scheduler
      result = Timeout.timeout(1) { :message }
      begin
        Timeout.timeout(0.01) { Kernel.sleep(1) }
      rescue Timeout::Error => e
        error = e
      end
    end
    assert_nil current
    assert_equal :message, result
    assert_kind_of Timeout::Error, error
  end
end
