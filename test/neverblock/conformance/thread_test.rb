# frozen_string_literal: true

require_relative "conformance_helper"

# Thread#join and Thread#value from scheduled fibers, and the scheduler's
# life cycle on its thread (the loop runs when the thread ends).
class ConformanceThreadTest < ConformanceTest
  def test_a_fiber_gets_the_value_of_a_thread
    result = nil
    on_scheduler_thread { schedule { result = Thread.new { :done }.value } }
    assert_equal :done, result
  end

  def test_other_fibers_run_while_one_joins_a_thread
    go = Thread::Queue.new
    result = nil
    on_scheduler_thread do
      schedule do
        # The thread can only finish once the other fiber has run.
        result = Thread.new { go.pop }.value
      end
      schedule { go << :released_by_the_other_fiber }
    end
    assert_equal :released_by_the_other_fiber, result
  end

  def test_many_fibers_join_many_threads_at_once
    results = []
    duration = elapsed do
      on_scheduler_thread do
        20.times do |index|
          schedule do
            results << Thread.new do
              Kernel.sleep(0.2)
              index
            end.value
          end
        end
      end
    end
    assert_equal (0...20).to_a, results.sort
    assert_operator duration, :<, 2, "20 threads of 0.2 s joined one after the other?"
  end

  def test_thread_value_raises_what_ended_the_thread
    error = nil
    on_scheduler_thread do
      schedule do
        thread = Thread.new { raise ArgumentError, "from the thread" }
        thread.report_on_exception = false
        thread.value
      rescue ArgumentError => e
        error = e
      end
    end
    assert_equal "from the thread", error&.message
  end

  # Ruby's test_thread_join_timeout.
  def test_join_with_a_timeout_returns_nil_while_the_thread_still_runs
    requires_ruby "3.2", "Ruby 3.1's Thread#join ignores its timeout when a fiber scheduler blocks " \
                         "(it calls Scheduler#block again until the thread ends; Ruby's reference " \
                         "scheduler hangs the same way)"
    sleeper = Thread.new { Kernel.sleep }
    result = :unset
    waited = nil
    on_scheduler_thread { schedule { waited = elapsed { result = sleeper.join(0.05) } } }
    assert_nil result
    assert_operator waited, :>=, 0.04
    assert_operator waited, :<, 1
    assert_predicate sleeper, :alive?
  ensure
    sleeper&.kill&.join
  end

  def test_join_with_a_timeout_returns_the_thread_once_it_finishes
    go = Thread::Queue.new
    worker = Thread.new { go.pop }
    result = nil
    on_scheduler_thread do
      schedule { result = worker.join(5) }
      schedule { go << true }
    end
    assert_same worker, result
  end

  # Ruby's test_thread_join_blocking: a blocking fiber inside a scheduled
  # fiber joins the ordinary way, without the scheduler.
  def test_a_blocking_fiber_inside_a_scheduled_fiber_joins_a_thread
    result = nil
    on_scheduler_thread do
      schedule do
        Fiber.new(blocking: true) do
          Thread.new do
            Kernel.sleep(0)
            result = :done
          end.join
        end.resume
      end
    end
    assert_equal :done, result
  end

  # Ruby's test_thread_join_implicit.
  def test_the_loop_finishes_pending_fibers_before_the_thread_ends
    finished = false
    thread = Thread.new do
      Fiber.set_scheduler(NeverBlock::Scheduler.new)
      Fiber.schedule do
        sleep 0.05
        finished = true
      end
      :thread_value
    end
    assert_equal :thread_value, thread.value
    assert finished, "the scheduled fiber did not finish before the thread ended"
  end

  def test_the_scheduler_is_closed_when_its_thread_ends
    scheduler = Thread.new do
      scheduler = NeverBlock::Scheduler.new
      Fiber.set_scheduler(scheduler)
      scheduler
    end.value
    assert_predicate scheduler, :closed?
  end

  def test_setting_the_scheduler_to_nil_runs_pending_fibers_and_closes_it
    events = []
    on_scheduler_thread do
      scheduler = Fiber.scheduler
      schedule do
        sleep 0.01
        events << :fiber_finished
      end
      Fiber.set_scheduler(nil)
      events << :scheduler_removed << scheduler.closed?
    end
    assert_equal [:fiber_finished, :scheduler_removed, true], events
  end

  # Ruby's test_close_at_exit: the main thread's scheduler is closed, and its
  # pending fibers run, when the program ends.
  def test_pending_fibers_of_the_main_thread_run_at_program_exit
    out, err, status = run_script(<<~RUBY)
      require "neverblock"
      Fiber.set_scheduler(NeverBlock::Scheduler.new)
      Fiber.schedule do
        sleep 0.01
        puts "fiber ran"
      end
    RUBY
    assert_equal "fiber ran\n", out
    assert_equal "", err
    assert_predicate status, :success?
  end
end
