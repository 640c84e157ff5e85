# frozen_string_literal: true

require "test_helper"

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
end
