# frozen_string_literal: true

require_relative "conformance_helper"

# Kernel#sleep in scheduled fibers (Scheduler#kernel_sleep): only the
# sleeping fiber waits.
class ConformanceSleepTest < ConformanceTest
  def test_ten_fibers_sleep_at_the_same_time
    woke = 0
    duration = elapsed do
      on_scheduler_thread do
        10.times do
          schedule do
            sleep 0.2
            woke += 1
          end
        end
      end
    end
    assert_equal 10, woke
    assert_operator duration, :>=, 0.19
    assert_operator duration, :<, 1, "ten 0.2 s sleeps ran one after the other?"
  end

  # Ruby's test_sleep.
  def test_shorter_sleeps_end_first
    order = []
    on_scheduler_thread do
      [4, 3, 2, 1, 0].each do |index|
        schedule do
          assert_operator sleep(index * 0.02), :>=, 0
          order << index
        end
      end
    end
    assert_equal [0, 1, 2, 3, 4], order
  end

  # Ruby's test_sleep_returns_seconds_slept: Kernel#sleep returns whole
  # seconds, as without a scheduler.
  def test_sleep_returns_the_whole_seconds_slept
    slept = nil
    on_scheduler_thread { schedule { slept = sleep(1) } }
    assert_kind_of Integer, slept
    assert_includes [1, 2], slept
  end

  def test_sleep_zero_lets_the_other_fibers_run
    other_ran = false
    on_scheduler_thread do
      # If sleep(0) did not give way, this fiber would spin forever.
      schedule { sleep(0) until other_ran }
      schedule do
        sleep(0)
        other_ran = true
      end
    end
    assert other_ran
  end

  def test_a_sleeping_fiber_does_not_hold_up_io_in_another
    reader, writer = IO.pipe
    events = []
    feeder = Thread.new do
      Kernel.sleep(0.02)
      writer.write("x")
    end
    on_scheduler_thread do
      schedule do
        sleep 0.3
        events << :sleeper_woke
      end
      schedule { events << [:read, reader.read(1)] }
    end
    assert_equal [[:read, "x"], :sleeper_woke], events
  ensure
    feeder&.join
    reader&.close
    writer&.close
  end

  def test_a_sleeping_fiber_does_not_hold_up_other_threads_loops
    woke = Thread::Queue.new
    duration = elapsed do
      threads = 4.times.map do
        Thread.new do
          on_scheduler_thread do
            schedule do
              sleep 0.2
              woke << true
            end
          end
        end
      end
      threads.each(&:join)
    end
    assert_equal 4, woke.size
    assert_operator duration, :<, 1
  end

  # A thread in `sleep` (no duration) is no deadlock to Ruby: a signal may
  # end it. Fibers of a loop in that sleep, with a stall detector thread
  # waiting too, must not be taken for one ("No live threads left.
  # Deadlock?" killed such a process, a worker waiting for its TERM).
  def test_fibers_sleeping_without_a_duration_wait_for_a_signal_not_a_deadlock_error
    lib = File.expand_path("../../../lib", __dir__)
    code = <<~RUBY
      require "neverblock"
      NeverBlock.run(stall_threshold: 0.1) do
        2.times { NeverBlock.spawn { sleep } }
        sleep 0.2 # the stall detector's thread is idle by now
        puts "sleeping"
        $stdout.flush
        sleep
      end
    RUBY
    Open3.popen3(RbConfig.ruby, "-I#{lib}", "-e", code) do |stdin, stdout, stderr, waiter|
      stdin.close
      assert_equal "sleeping\n", stdout.gets
      refute waiter.join(1), -> { "the sleeping process ended: #{stderr.read}" }
      Process.kill(:TERM, waiter.pid)
      assert_equal Signal.list["TERM"], waiter.value.termsig
      refute_match(/Deadlock/, stderr.read)
    end
  end
end
