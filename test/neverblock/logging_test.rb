# frozen_string_literal: true

require "test_helper"
require_relative "../fixtures/child_ruby"

# What happens to an exception that escapes a task: the loop goes on, and
# the exception is logged once (nobody waiting) or re-raised to whoever
# waits (and then not logged). Fatal exceptions stop the loop. These tests
# start their own loops to see them end, so they run outside one.
class LoggingTest < PlainTest
  include ChildRuby

  def test_a_failed_task_nobody_waits_for_is_logged_once_with_its_backtrace
    spawn_line = raise_line = nil
    log = capture_log do
      NeverBlock.run do
        spawn_line = __LINE__ + 1
        NeverBlock.spawn do
          raise_line = __LINE__ + 1
          raise ArgumentError, "bad input"
        end
      end
    end
    assert_equal 1, log.scan("unhandled").size, log
    assert_match(/ERROR -- NeverBlock: unhandled ArgumentError in #<NeverBlock::Task:0x\h+ failed /, log)
    assert_includes log, "(#{__FILE__}:#{spawn_line})>: bad input", "names the task by where it was spawned"
    assert_match(/^  #{Regexp.escape("#{__FILE__}:#{raise_line}")}:in /, log, "with the backtrace")
  end

  def test_a_failed_task_does_not_stop_the_other_tasks
    log = capture_log do
      result = NeverBlock.run do
        reader, writer = IO.pipe
        reading = NeverBlock.spawn { reader.read(4) }
        failing = NeverBlock.spawn { raise "boom" }
        sleep 0.001 until failing.finished? # not #wait: a waiter would take the failure
        later = NeverBlock.spawn { :spawned_after_the_failure }
        writer.write("data")
        [reading.value, later.value, failing.status]
      ensure
        reader.close
        writer.close
      end
      assert_equal ["data", :spawned_after_the_failure, :failed], result
    end
    assert_equal 1, log.scan("unhandled RuntimeError").size
  end

  def test_value_re_raises_to_the_waiter_and_nothing_is_logged
    log = capture_log do
      NeverBlock.run do
        task = NeverBlock.spawn do
          sleep 0.001
          raise KeyError, "missing"
        end
        error = assert_raises(KeyError) { task.value }
        assert_equal "missing", error.message
      end
    end
    assert_empty log
  end

  # wait_all is waiting for every task it was given, even while it still
  # waits for an earlier one.
  def test_wait_all_re_raises_a_failure_and_does_not_log_it
    log = capture_log do
      NeverBlock.run do
        tasks = [NeverBlock.spawn { sleep 0.01; :slow }, NeverBlock.spawn { raise "fast failure" }]
        error = assert_raises(RuntimeError) { NeverBlock.wait_all(tasks) }
        assert_equal "fast failure", error.message
      end
    end
    assert_empty log, "the failure reached the caller of wait_all; logging it as unhandled too is a false alarm"
  end

  # Nobody was waiting when it failed, so it was logged; a later #value
  # still raises it.
  def test_a_task_that_failed_before_anyone_waited_is_logged_and_value_still_raises
    log = capture_log do
      NeverBlock.run do
        task = NeverBlock.spawn { raise "early" }
        sleep 0.05 # several turns of the loop with nobody asking
        assert_raises(RuntimeError) { task.value }
      end
    end
    assert_equal 1, log.scan("unhandled RuntimeError").size
  end

  def test_the_run_blocks_own_exception_is_raised_not_logged
    log = capture_log do
      assert_raises(IndexError) { NeverBlock.run { raise IndexError, "out of range" } }
    end
    assert_empty log
  end

  def test_cancelled_tasks_are_not_logged
    statuses = nil
    log = capture_log do
      NeverBlock.run do
        running = NeverBlock.spawn { sleep }
        pool = NeverBlock::FiberPool.new(size: 1)
        pool.spawn { sleep 0.01 }
        pending = pool.spawn { :never_runs } # queued behind the first
        pending.cancel
        sleep 0.001 until running.status == :running
        running.cancel
        sleep 0.001 while running.alive?
        statuses = [running.status, pending.status]
      end
    end
    assert_equal %i[cancelled cancelled], statuses
    assert_empty log
  end

  def test_interrupt_in_a_task_stops_the_loop_and_cancels_the_others
    cleaned = []
    others = []
    took = elapsed do
      assert_raises(Interrupt) do
        capture_log do
          NeverBlock.run do
            others << NeverBlock.spawn do
              sleep 30
            ensure
              cleaned << :sleeper
            end
            begin
              # spawn runs the task at once: the Interrupt comes while the
              # root is still inside this call
              NeverBlock.spawn { raise Interrupt }
              sleep 30
            ensure
              cleaned << :root
            end
          end
        end
      end
    end
    assert_operator took, :<, 5, "the loop stopped without waiting for the 30 s sleeps"
    assert_equal %i[root sleeper], cleaned.sort, "every other task's ensure block ran"
    assert_predicate others.first, :cancelled?
    assert_nil Fiber.scheduler
  end

  def test_exit_in_a_task_stops_the_loop_and_propagates
    cleaned = false
    error = assert_raises(SystemExit) do
      capture_log do
        NeverBlock.run do
          NeverBlock.spawn do
            sleep 30
          ensure
            cleaned = true
          end
          NeverBlock.spawn { exit 3 }.wait
          flunk "the loop went on after exit"
        end
      end
    end
    assert_equal 3, error.status
    assert cleaned
  end

  def test_a_fatal_exception_in_the_run_block_cancels_the_tasks
    cleaned = false
    assert_raises(Interrupt) do
      NeverBlock.run do
        NeverBlock.spawn do
          sleep 30
        ensure
          cleaned = true
        end
        sleep 0.001
        raise Interrupt
      end
    end
    assert cleaned
  end

  def test_the_default_logger_writes_to_stderr
    code = <<~RUBY
      require "neverblock"
      NeverBlock.run { NeverBlock.spawn { raise "to stderr" } }
      puts NeverBlock.logger.class
    RUBY
    out, err, status = ruby_child("-e", code)
    assert status.success?, err
    assert_equal "Logger", out.strip
    assert_match(/ERROR -- NeverBlock: unhandled RuntimeError in #<NeverBlock::Task:0x\h+ failed \(-e:2\)>: to stderr/, err)
    assert_match(/^  -e:2:in /, err)
  end
end
