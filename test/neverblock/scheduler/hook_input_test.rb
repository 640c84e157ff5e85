# frozen_string_literal: true

require "test_helper"
require "active_support/duration"

# Bad input reaching the scheduler through Ruby's own calls.
class SchedulerHookInputTest < NeverBlockTest
  def test_a_negative_sleep_raises_like_ruby
    error = assert_raises(ArgumentError) { sleep(-1) }
    assert_match(/negative/, error.message)
  end

  def test_a_nan_sleep_raises_argument_error_and_the_loop_goes_on
    assert_raises(ArgumentError) { sleep(Float::NAN) }
    assert_equal :alive, NeverBlock.spawn { sleep 0.01; :alive }.value
  end

  def test_an_infinite_timeout_means_no_timeout
    queue = Thread::Queue.new
    NeverBlock.spawn { sleep 0.02; queue << :item }
    assert_equal :item, Timeout.timeout(Float::INFINITY) { queue.pop }
  end

  def test_post_needs_a_callable
    assert_raises(ArgumentError) { Fiber.scheduler.post }
    assert_raises(ArgumentError) { Fiber.scheduler.post(:not_callable) }
  end

  def test_a_failing_posted_callable_is_logged_and_the_loop_goes_on
    scheduler = Fiber.scheduler
    ran = Thread::Queue.new
    log = capture_log do
      Thread.new do
        scheduler.post { raise "posted bug" }
        scheduler.post { ran << true } # the inbox is first in, first out
      end.join
      ran.pop
    end
    assert_match(/RuntimeError in a callable posted to the loop: posted bug/, log)
    assert_equal :alive, NeverBlock.spawn { :alive }.value
  end

  # ActiveSupport::Duration (`sleep 1.second` in a Rails app or job) reaches
  # the hooks as it was passed: Ruby's own sleep and timeouts take it, and a
  # timer made with it once left its deadline a Duration, which the selector
  # refused (TypeError) and the loop died of.
  def test_sleep_takes_an_active_support_duration
    started = NeverBlock::Clock.now
    sleep(ActiveSupport::Duration.build(0.05))
    assert_operator NeverBlock::Clock.now - started, :>=, 0.05
    assert_equal :alive, NeverBlock.spawn { sleep 0.01; :alive }.value
  end

  def test_a_timeout_takes_an_active_support_duration
    assert_raises(Timeout::Error) { Timeout.timeout(ActiveSupport::Duration.build(0.05)) { sleep 5 } }
    assert_equal :alive, NeverBlock.spawn { :alive }.value
  end

  def test_a_condition_variable_wait_takes_an_active_support_duration
    mutex = Mutex.new
    condition = ConditionVariable.new
    started = NeverBlock::Clock.now
    mutex.synchronize { condition.wait(mutex, ActiveSupport::Duration.build(0.05)) }
    assert_operator NeverBlock::Clock.now - started, :>=, 0.05
  end

  def test_an_io_wait_takes_an_active_support_duration
    reader, writer = IO.pipe
    assert_nil reader.wait_readable(ActiveSupport::Duration.build(0.05))
  ensure
    reader&.close
    writer&.close
  end
end
