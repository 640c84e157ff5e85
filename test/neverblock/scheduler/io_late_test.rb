# frozen_string_literal: true

require "test_helper"
require_relative "../../support/ready_descriptors"

# Scheduler#io_late: how long descriptors have been left ready from one
# turn to the next, the lateness of a loop whose work comes from IO (a relay
# reading a thousand upstream streams) rather than from its timers.
class SchedulerIOLateTest < NeverBlockTest
  include ReadyDescriptors

  # More descriptors always ready than a selector call takes (64 on epoll),
  # each fiber spending a little CPU before it waits again: every call
  # comes back full, turn after turn.
  def test_descriptors_left_ready_turn_after_turn_make_the_loop_late
    skip_unless_batched_selector
    scheduler = Fiber.scheduler
    with_ready_fibers(100) do
      lates = 20.times.map do
        scheduler.yield
        scheduler.io_late
      end
      assert_operator lates.max, :>, 0.0, "every selector call came back full, yet io_late stayed 0: #{lates.inspect}"
      assert_operator lates.last, :>=, lates.first, "io_late counts from the first full call: #{lates.inspect}"
    end
    scheduler.yield # the fibers are gone: the next call finds nothing ready
    scheduler.yield
    assert_equal 0.0, scheduler.io_late
  end

  def test_fewer_ready_than_a_call_takes_is_not_late
    scheduler = Fiber.scheduler
    with_ready_fibers(10) do
      20.times do
        scheduler.yield
        assert_equal 0.0, scheduler.io_late
      end
    end
  end
end
