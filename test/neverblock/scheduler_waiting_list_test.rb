# frozen_string_literal: true

require "test_helper"

# io-event links each fiber waiting in a selector into the selector's list
# for the descriptor, through a node on that fiber's own stack. A selector
# freed by the GC while a node is still linked writes into that node, which
# by then may belong to a fiber of another, live selector: that selector's
# list loops on itself and the next GC mark spins forever. So no scheduler
# may let its selector go with a fiber still waiting in it, however the
# scheduler ends.
#
# Each scenario runs in a child Ruby: the failure is a hang inside the GC,
# which only killing the process ends. Schedulers are created and let go by
# the thousand, a few kept alive at a time, with garbage of varying size in
# between, so that the GC frees a fiber and its selector at different times
# and a new fiber gets the freed stack in between. Before the fix, each of
# these hung within a few seconds.
class SchedulerWaitingListTest < PlainTest
  PRELUDE = <<~RUBY
    require "neverblock"
    $stdout.sync = true
    NeverBlock.logger = Logger.new(nil)

    # Creates a scheduler with `make`, `count` times, keeping the last three
    # alive and allocating garbage in between.
    def churn(count, &make)
      live = []
      count.times do
        live << make.call
        Array.new(rand(600)) { "x" * 30 }
        live.shift if live.size > 3
      end
    end
  RUBY

  def test_schedulers_closed_after_running_never_leave_a_fiber_in_their_selector
    assert_survives(<<~RUBY)
      churn(10_000) do
        scheduler = NeverBlock::Scheduler.new(stall_threshold: nil)
        scheduler.close
        scheduler
      end
    RUBY
  end

  def test_schedulers_dropped_without_close_never_leave_a_fiber_in_their_selector
    assert_survives(<<~RUBY)
      churn(10_000) { NeverBlock::Scheduler.new(stall_threshold: nil) }
    RUBY
  end

  def test_loops_on_threads_whose_fibers_waited_on_sockets_in_every_way
    assert_survives(<<~RUBY, iterations: 1_000)
      churn(ITERATIONS) do
        scheduler = nil
        Thread.new do
          NeverBlock.run do
            scheduler = Fiber.scheduler
            pairs = Array.new(4) { UNIXSocket.pair }
            tasks = [
              NeverBlock.spawn { pairs[0][0].read(1) },                  # woken by data
              NeverBlock.spawn { pairs[1][0].wait_readable(0.001) },     # timed out
              NeverBlock.spawn { pairs[2][0].read(1) },                  # cancelled
              NeverBlock.spawn do                                        # interrupted by Timeout
                Timeout.timeout(0.001) { pairs[3][0].read(1) }
              rescue Timeout::Error
                nil
              end
            ]
            sleep 0.002
            tasks[2].cancel
            pairs[0][1].write("x")
            tasks.each(&:wait)
            pairs.flatten.each(&:close)
          end
        end.join
        GC.start(immediate_sweep: false) if rand(10).zero?
        scheduler
      end
    RUBY
  end

  def test_a_loop_that_cannot_end_its_tasks_keeps_its_selector
    assert_survives(<<~RUBY, iterations: 1_500)
      churn(ITERATIONS) do
        scheduler = nil
        Thread.new do
          NeverBlock.run do
            scheduler = Fiber.scheduler
            pairs = Array.new(2) { UNIXSocket.pair }
            # Cancelled when the loop aborts, this task raises Interrupt,
            # which ends Scheduler#close before it has cancelled the next
            # one: that one is left waiting in the selector.
            NeverBlock.spawn do
              pairs[0][0].read(1)
            ensure
              raise Interrupt
            end
            NeverBlock.spawn { pairs[1][0].read(1) }
            NeverBlock.spawn { raise Interrupt }
            sleep 0.01
          end
        rescue Interrupt
          nil
        end.join
        scheduler
      end
    RUBY
  end

  private

  # Runs `code` after PRELUDE in a child and asserts it ends, and well.
  def assert_survives(code, iterations: 0, timeout: 60)
    out, err, status = run_ruby("#{PRELUDE}ITERATIONS = #{iterations}\n#{code}\nputs :done", timeout: timeout)
    assert status.success?, "the child failed:\n#{out}\n#{err}"
    assert_equal "done\n", out
  end
end
