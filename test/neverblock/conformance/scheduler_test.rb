# frozen_string_literal: true

require_relative "conformance_helper"
require "tmpdir"

# Fiber.schedule and the scheduler as a whole (Ruby's test_scheduler.rb and
# test_fiber.rb): how fibers start, what they see, and that one failing
# fiber leaves the others alone.
class ConformanceSchedulerTest < ConformanceTest
  def test_fiber_schedule_without_a_scheduler_raises
    error = Thread.new do
      Fiber.schedule {}
    rescue RuntimeError => e
      e
    end.value
    assert_kind_of RuntimeError, error
  end

  def test_fiber_schedule_starts_the_fiber_at_once_and_returns_it
    events = []
    returned = nil
    on_scheduler_thread do
      returned = Fiber.schedule do
        events << :fiber_started
        sleep 0.01
        events << :fiber_finished
      end
      events << :schedule_returned
    end
    assert_instance_of Fiber, returned
    assert_equal %i[fiber_started schedule_returned fiber_finished], events
  end

  def test_scheduled_fibers_are_non_blocking_and_the_root_fiber_is_blocking
    seen = {}
    on_scheduler_thread do
      seen[:root] = Fiber.current.blocking?
      schedule { seen[:scheduled] = Fiber.current.blocking? }
    end
    assert_equal({ root: true, scheduled: false }, seen)
  end

  def test_fiber_blocking_makes_a_scheduled_fiber_blocking_for_the_block
    requires_ruby "3.2", "Fiber.blocking is new in Ruby 3.2"
    seen = []
    on_scheduler_thread do
      schedule do
        seen << Fiber.current.blocking?
        Fiber.blocking { seen << Fiber.current.blocking? << Fiber.current_scheduler }
        seen << Fiber.current.blocking?
      end
    end
    assert_equal [false, true, nil, false], seen
  end

  # Ruby's test_current_scheduler.
  def test_current_scheduler_is_nil_on_the_root_fiber_and_set_in_scheduled_fibers
    seen = {}
    on_scheduler_thread do
      scheduler = Fiber.scheduler
      seen[:scheduler_on_root] = scheduler.is_a?(NeverBlock::Scheduler)
      seen[:current_on_root] = Fiber.current_scheduler
      schedule { seen[:current_in_fiber] = Fiber.current_scheduler.equal?(scheduler) }
    end
    assert_equal({ scheduler_on_root: true, current_on_root: nil, current_in_fiber: true }, seen)
  end

  # Ruby's test_autoload: fibers racing to autoload one constant whose file
  # waits while it loads.
  def test_fibers_racing_to_autoload_a_constant_all_get_it
    requires_ruby "3.2", "on Ruby 3.1, fibers that reach a constant while another fiber is still " \
                         "autoloading it get NameError (Ruby's reference scheduler too)"
    Dir.mktmpdir do |directory|
      path = File.join(directory, "conformance_slow_constant.rb")
      File.write(path, "sleep 0.02\nConformanceSlowConstant = Object.new\n")
      Object.autoload(:ConformanceSlowConstant, path)
      begin
        values = []
        on_scheduler_thread { 10.times { schedule { values << Object.const_get(:ConformanceSlowConstant) } } }
        assert_equal 10, values.size
        assert_equal 1, values.uniq.size
      ensure
        Object.send(:remove_const, :ConformanceSlowConstant) if Object.const_defined?(:ConformanceSlowConstant, false)
        $LOADED_FEATURES.delete(path)
      end
    end
  end

  # As with Ruby's reference scheduler (test/fiber's test_broken_unblock):
  # raw Fiber.schedule use has nobody to report to but the thread.
  def test_an_exception_escaping_a_raw_fiber_reaches_thread_join
    finished = []
    error = assert_raises(ArgumentError) do
      on_scheduler_thread do
        Fiber.schedule do
          sleep 0.01
          raise ArgumentError, "one fiber failed"
        end
        schedule do
          sleep 5
          finished << :slow
        end
      end
    end
    assert_equal "one fiber failed", error.message
    assert_empty finished, "the loop stopped at the failure"
  end

  def test_run_without_a_block_raises_what_escaped_a_fiber_and_close_finishes_the_rest
    finished = []
    escaped = on_scheduler_thread do
      scheduler = Fiber.scheduler
      Fiber.schedule { raise ArgumentError, "escaped" }
      schedule { sleep 0.02; finished << :other }
      begin
        scheduler.run
      rescue ArgumentError => e
        e.message
      end
    end
    assert_equal "escaped", escaped
    assert_equal [:other], finished, "closing at thread exit ran the remaining fiber"
  end

  def test_an_exception_in_a_fiber_scheduled_under_neverblock_run_is_logged_and_the_others_go_on
    finished = []
    log = capture_log do
      NeverBlock.run do
        Fiber.schedule do
          sleep 0.01
          raise ArgumentError, "one fiber failed"
        end
        3.times { |index| Fiber.schedule { sleep 0.05; finished << index } }
      end
    end
    assert_equal [0, 1, 2], finished.sort
    assert_match(/ArgumentError.*one fiber failed/, log)
  end

  def test_a_scheduler_created_on_one_thread_serves_the_thread_it_is_set_on
    scheduler = NeverBlock::Scheduler.new
    slept = nil
    thread = Thread.new do
      Fiber.set_scheduler(scheduler)
      Fiber.schedule { slept = sleep(0.01) }
    end
    thread.join(HANG_LIMIT) or flunk "hung"
    # Kernel#sleep returns whole seconds of wall-clock time (time(2) after
    # minus before): 1 when the 10 ms cross a second's boundary.
    assert_includes [0, 1], slept, "the scheduled fiber slept"
    assert_predicate scheduler, :closed?, "closed when its thread ended"
    assert_same thread, scheduler.thread
  end

  def test_a_scheduler_created_on_one_thread_is_closed_there_when_set_to_nil
    scheduler = NeverBlock::Scheduler.new
    closed = Thread.new do
      Fiber.set_scheduler(scheduler)
      Fiber.set_scheduler(nil)
      scheduler.closed?
    end.value
    assert closed
  end

  def test_a_scheduler_in_use_refuses_a_second_thread
    scheduler = NeverBlock::Scheduler.new
    reader, writer = IO.pipe
    first = Thread.new do
      Fiber.set_scheduler(scheduler)
      Fiber.schedule { reader.read(1) } # keeps the scheduler busy on this thread
      :first_done
    end
    Thread.pass until scheduler.tasks.any? || !first.alive?
    error = assert_raises(NeverBlock::Error) do
      Thread.new do
        Thread.current.report_on_exception = false
        Fiber.set_scheduler(scheduler)
        Fiber.schedule { :never }
      ensure
        Fiber.set_scheduler(nil) rescue nil # rubocop:disable Style/RescueModifier -- it refuses to close here too
      end.join
    end
    assert_match(/create one scheduler per thread/, error.message)
    writer.write("x")
    assert_equal :first_done, first.value
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end

  def test_run_without_a_block_runs_until_every_scheduled_fiber_finished
    order = on_scheduler_thread do
      order = []
      Fiber.schedule { sleep 0.02; order << :slow }
      Fiber.schedule { sleep 0.01; order << :fast }
      Fiber.scheduler.run
      order << :after_run
    end
    assert_equal %i[fast slow after_run], order
  end

  # As Ruby's reference scheduler (test_mutex_deadlock): a fiber scheduled
  # from the thread's root fiber is resumed, so Fiber.yield returns to the
  # caller of Fiber.schedule; the loop no longer waits for that fiber.
  def test_fiber_yield_in_a_fiber_scheduled_from_the_root_returns_to_the_caller
    events = on_scheduler_thread do
      events = []
      yielded = Fiber.schedule do
        events << :before_yield
        events << Fiber.yield(:handed_back)
      end
      events << :caller_resumed
      Fiber.schedule { sleep 0.01; events << :other_fiber }
      Fiber.scheduler.run
      events << yielded.alive?
      yielded.resume(:resumed_by_the_caller)
      events << yielded.alive?
    end
    assert_equal [:before_yield, :caller_resumed, :other_fiber, true, :resumed_by_the_caller, false], events
  end

  def test_an_exception_in_one_task_does_not_stop_the_others
    finished = []
    log = capture_log do
      NeverBlock.run do
        NeverBlock.spawn { raise ArgumentError, "one task failed" }
        3.times do |index|
          NeverBlock.spawn do
            sleep 0.01
            finished << index
          end
        end
      end # run returns once every task has finished
    end
    assert_equal [0, 1, 2], finished
    assert_match(/ArgumentError.*one task failed/, log)
  end
end
