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

  def test_an_exception_in_one_fiber_does_not_stop_the_others
    finished = []
    log = capture_log do
      on_scheduler_thread do
        Fiber.schedule do
          sleep 0.01
          raise ArgumentError, "one fiber failed"
        end
        3.times do |index|
          schedule do
            sleep 0.05
            finished << index
          end
        end
      end
    end
    assert_equal [0, 1, 2], finished.sort
    assert_match(/ArgumentError.*one fiber failed/, log)
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
