# frozen_string_literal: true

require "test_helper"

# NeverBlock.sleep, NeverBlock.timeout and the stdlib Timeout / Kernel#sleep
# inside the loop.
class TimeoutTest < NeverBlockTest
  def test_timeout_raises_a_neverblock_timeout_error_at_the_current_wait
    error = assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.05) { sleep 5 } }
    assert_kind_of Timeout::Error, error
    assert_match(/0\.05 s/, error.message)
  end

  def test_timeout_error_is_a_neverblock_error_for_rescue
    rescued = begin
      NeverBlock.timeout(0.01) { sleep 1 }
    rescue NeverBlock::Error => e
      e
    end
    assert_kind_of NeverBlock::TimeoutError, rescued
    refute NeverBlock::PoolFull === rescued, "a TimeoutError is not a PoolFull"
  end

  def test_timeout_error_is_a_neverblock_error_and_a_timeout_error_for_is_a
    error = NeverBlock::TimeoutError.new("late")
    assert error.is_a?(NeverBlock::Error)
    assert error.is_a?(Timeout::Error)
    assert_includes NeverBlock::TimeoutError.ancestors, NeverBlock::Error
  end

  def test_every_neverblock_error_class_is_a_neverblock_error
    classes = NeverBlock.constants.map { |name| NeverBlock.const_get(name) }
                        .select { |constant| constant.is_a?(Class) && constant < Exception }
    refute_empty classes
    classes.each { |klass| assert klass < NeverBlock::Error, "#{klass} is not a NeverBlock::Error" }
  end

  def test_raise_neverblock_error_with_a_message_raises_a_base_error
    error = assert_raises(NeverBlock::Error) { raise NeverBlock::Error, "told what to do" }
    assert_instance_of NeverBlock::BaseError, error
    assert_equal "told what to do", error.message
    assert_kind_of StandardError, error
  end

  def test_timeout_returns_the_block_value_in_time
    assert_equal :fast, NeverBlock.timeout(1) { sleep 0.01; :fast }
  end

  def test_timeout_suspends_only_the_calling_fiber
    other = NeverBlock.spawn { sleep 0.05; :other_done }
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.1) { sleep 5 } }
    assert_equal :other_done, other.value
  end

  def test_timeout_interrupts_io_waits
    reader, writer = IO.pipe
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.05) { reader.read(1) } }
    writer.write("y")
    assert_equal "y", reader.read(1), "the cancelled read left the pipe usable"
  ensure
    reader&.close
    writer&.close
  end

  def test_timeout_runs_ensure_blocks
    cleaned = false
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.01) do
        sleep 1
      ensure
        cleaned = true
      end
    end
    assert cleaned
  end

  def test_zero_expires_at_the_first_wait
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0) { sleep 1 } }
  end

  def test_nil_means_no_limit
    assert_equal :done, NeverBlock.timeout(nil) { sleep 0.01; :done }
  end

  def test_nested_timeouts_inner_fires_first
    outer = NeverBlock.timeout(1) do
      assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.02) { sleep 1 } }
      :outer_survived
    end
    assert_equal :outer_survived, outer
  end

  def test_nested_timeouts_outer_fires_first
    time = elapsed do
      assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.05) { NeverBlock.timeout(5) { sleep 10 } } }
    end
    assert_operator time, :<, 1
  end

  # Code under a timeout that rescues Timeout::Error for timeouts of its
  # own must not take the expiry for one of them.
  def test_a_timeout_error_rescue_inside_the_block_does_not_swallow_the_expiry
    swallowed = []
    time = elapsed do
      assert_raises(NeverBlock::TimeoutError) do
        NeverBlock.timeout(0.05) do
          begin
            sleep 2
          rescue Timeout::Error => e
            swallowed << e
          end
          sleep 2
        end
      end
    end
    assert_empty swallowed
    assert_operator time, :<, 1
  end

  # Cleanup code that rescues StandardError and re-raises (ActiveRecord
  # marking a connection for verification) still runs.
  def test_cleanup_code_that_rescues_standard_error_sees_the_expiry
    cleaned = []
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.05) do
        sleep 2
      rescue StandardError => e
        cleaned << e.class
        raise
      end
    end
    assert_equal [NeverBlock::TimeoutError::Expired], cleaned
  end

  # A library that wraps what it rescued in an error of its own: the caller
  # still gets a TimeoutError, with the library's error as the cause.
  def test_an_expiry_a_library_wrapped_is_still_a_timeout_error
    library_error = Class.new(StandardError)
    error = assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.05) do
        sleep 2
      rescue StandardError
        raise library_error, "connection failed"
      end
    end
    assert_kind_of library_error, error.cause
  end

  # Net::HTTP retries an idempotent request after a Timeout::Error: with
  # the error raised inside the block, a timed GET ran to its end (3 s).
  def test_timeout_ends_a_net_http_get_that_would_retry
    require "net/http"
    server = TCPServer.new("127.0.0.1", 0)
    requests = 0
    handlers = []
    acceptor = NeverBlock.spawn do
      loop do
        client = server.accept
        requests += 1
        handlers << NeverBlock.spawn do
          client.readpartial(4096)
          sleep 2
          client.write("HTTP/1.1 200 OK\r\nContent-Length: 4\r\nConnection: close\r\n\r\nslow")
        ensure
          client.close
        end
      end
    end
    url = URI("http://127.0.0.1:#{server.addr[1]}/slow")
    time = elapsed do
      assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.3) { Net::HTTP.get_response(url) } }
    end
    assert_operator time, :<, 1.5
    assert_equal 1, requests, "the GET was sent once, not retried"
  ensure
    # Cancelled, then waited for: a handler's ensure closes its socket, which
    # Ruby may hand to the thread pool (blocking_operation_wait, 4.0; 3.4 did
    # before NeverBlock stopped offering the hook there), so the task can
    # outlive a bare cancel (seen under YJIT).
    tasks = [acceptor, *handlers].compact
    tasks.each(&:cancel)
    tasks.each(&:wait)
    server&.close
  end

  def test_an_inner_timeout_error_is_an_ordinary_error_to_the_outer_block
    value = NeverBlock.timeout(2) do
      NeverBlock.timeout(0.01) { sleep 1 }
    rescue NeverBlock::TimeoutError => e
      [:rescued, e.class]
    end
    assert_equal [:rescued, NeverBlock::TimeoutError], value
  end

  def test_the_timeout_error_comes_from_the_wait_and_has_no_internal_cause
    error = assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.01) { sleep 1 } }
    assert_nil error.cause
    assert(error.backtrace.any? { |line| line.include?(__FILE__) })
  end

  def test_invalid_durations_raise_argument_error
    [-1, Float::NAN, Float::INFINITY, "1", Complex(1, 1)].each do |bad|
      assert_raises(ArgumentError, bad.inspect) { NeverBlock.timeout(bad) { :never } }
      assert_raises(ArgumentError, bad.inspect) { NeverBlock.sleep(bad) }
    end
  end

  def test_stdlib_timeout_suspends_only_the_calling_fiber
    tasks = 5.times.map do
      NeverBlock.spawn do
        Timeout.timeout(0.1) { sleep 5 }
      rescue Timeout::Error
        :timed_out
      end
    end
    time = elapsed { assert_equal [:timed_out] * 5, tasks.map(&:value) }
    assert_operator time, :<, 1
  end

  def test_stdlib_timeout_with_a_custom_exception_class
    custom = Class.new(StandardError)
    assert_raises(custom) { Timeout.timeout(0.01, custom) { sleep 1 } }
  end

  def test_neverblock_sleep_and_kernel_sleep_suspend_only_the_fiber
    time = elapsed do
      tasks = 5.times.map { NeverBlock.spawn { NeverBlock.sleep(0.1) } }
      tasks += 5.times.map { NeverBlock.spawn { sleep 0.1 } }
      tasks.each(&:wait)
    end
    assert_operator time, :<, 0.5
  end

  # Kernel#sleep returns whole seconds of wall-clock time (Ruby subtracts two
  # time(2) readings), so a 0.01 s sleep that crosses a second boundary
  # returns 1: the answer is within a second of the time taken, not rounded.
  def test_sleep_returns_whole_seconds_like_kernel_sleep
    slept = nil
    took = elapsed { slept = NeverBlock.sleep(0.01) }
    assert_kind_of Integer, slept
    assert_includes (took.floor..took.ceil), slept
  end
end

# The same calls outside any loop.
class TimeoutOutsideLoopTest < PlainTest
  def test_timeout_outside_a_loop_uses_the_stdlib
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.05) { sleep 1 } }
    assert_equal 1, NeverBlock.timeout(1) { 1 }
  end

  def test_a_timeout_error_rescue_inside_the_block_does_not_swallow_the_expiry_outside_a_loop
    swallowed = []
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.05) do
        begin
          sleep 2
        rescue Timeout::Error => e
          swallowed << e
        end
        sleep 2
      end
    end
    assert_empty swallowed
  end

  def test_zero_outside_a_loop_expires_too
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0) { sleep 1 } }
  end

  def test_sleep_outside_a_loop_blocks
    assert_operator elapsed { NeverBlock.sleep(0.05) }, :>=, 0.05
  end
end

# Timeout.timeout on the scheduler, as the timeout gem (>= 0.4) calls it.
class TimeoutGemTest < NeverBlockTest
  # timeout >= 0.4 hands the scheduler an exception object and recognises
  # it by identity when it comes back.
  def test_timeout_after_raises_an_exception_object_as_given
    marker = Class.new(Exception) { def exception(*) = self }.new("marker")
    raised = assert_raises(Exception) { Fiber.scheduler.timeout_after(0.01, marker) { sleep 1 } }
    assert_same marker, raised
  end

  def test_timeout_timeout_without_a_class_raises_timeout_error_with_its_message
    error = assert_raises(Timeout::Error) { Timeout.timeout(0.01) { sleep 1 } }
    assert_equal "execution expired", error.message
  end
end
