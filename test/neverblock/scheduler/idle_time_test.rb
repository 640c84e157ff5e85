# frozen_string_literal: true

require "test_helper"
require "socket"

# Scheduler#idle_time: the seconds the loop waited with nothing to run. The
# start pace reads the loop's busy share from it while streams are open.
class SchedulerIdleTimeTest < NeverBlockTest
  def test_time_waiting_for_a_timer_is_idle
    scheduler = Fiber.scheduler
    before = scheduler.idle_time
    sleep 0.2
    assert_operator scheduler.idle_time - before, :>=, 0.15, "a loop with only a sleeping fiber waited in its selector"
  end

  def test_time_waiting_for_io_is_idle
    scheduler = Fiber.scheduler
    reader, writer = IO.pipe
    NeverBlock.spawn do
      sleep 0.2
      writer.write("x")
    end
    before = scheduler.idle_time
    reader.read(1)
    assert_operator scheduler.idle_time - before, :>=, 0.15
  ensure
    reader&.close
    writer&.close
  end

  # Fibers woken by IO run inside the selector's call: their work is not
  # the call's wait. Two fibers pass a byte back and forth over a socket
  # pair, each spending a millisecond of CPU before it answers.
  def test_fibers_woken_by_io_are_not_idle
    scheduler = Fiber.scheduler
    left, right = UNIXSocket.pair
    players = [[left, true], [right, false]].map do |socket, serves|
      NeverBlock.spawn do
        socket.write("x") if serves
        100.times do
          socket.read(1)
          spun = NeverBlock::Clock.now
          nil while NeverBlock::Clock.now - spun < 0.001
          socket.write("x")
        end
      end
    end
    before = scheduler.idle_time
    began = NeverBlock::Clock.now
    players.each(&:wait)
    took = NeverBlock::Clock.now - began
    assert_operator scheduler.idle_time - before, :<, took / 4, "the loop always had a fiber to run"
  ensure
    left&.close
    right&.close
  end

  # Fibers that compute and yield turn after turn leave the loop no time to
  # wait: however little CPU the machine gives the process, none of it is
  # idle (a process waiting for the CPU is busy, not idle).
  def test_time_running_fibers_is_not_idle
    scheduler = Fiber.scheduler
    before = scheduler.idle_time
    began = NeverBlock::Clock.now
    spinner = NeverBlock.spawn do
      until NeverBlock::Clock.now - began > 0.3
        spun = NeverBlock::Clock.now
        nil while NeverBlock::Clock.now - spun < 0.001 # a millisecond of CPU
        scheduler.yield
      end
    end
    spinner.wait
    assert_operator scheduler.idle_time - before, :<, 0.03, "the loop never waited: fibers were always ready"
  end
end
