# frozen_string_literal: true

require "test_helper"
require "neverblock/testing"
require_relative "../fixtures/child_ruby"

# NeverBlock::Testing.run, the engine behind the minitest and RSpec helpers:
# one test body in a fresh loop, with a timeout, failing on leaked tasks and
# file descriptors. These tests start their own loops, so they run outside one.
class TestingTest < PlainTest
  include ChildRuby

  Testing = NeverBlock::Testing

  def test_returns_the_body_value
    assert_equal :done, Testing.run(timeout: 5) { :done }
  end

  def test_runs_the_body_as_a_task_inside_the_loop
    inside = Testing.run(timeout: 5) do
      [NeverBlock.neverblocking?, NeverBlock.spawn { :child }.value]
    end
    assert_equal [true, :child], inside
  end

  def test_a_test_that_finishes_does_not_wait_for_its_timeout
    took = elapsed { Testing.run(timeout: 30) { sleep 0.01 } }
    assert_operator took, :<, 5, "a passing test returned as soon as it finished, not at its 30 s timeout"
  end

  def test_timeout_raises_timeout_failure_with_the_live_fibers_backtraces
    helper_line = wait_line = nil
    error = assert_raises(Testing::TimeoutFailure) do
      Testing.run(timeout: 0.2, label: "Suite#test_hangs") do
        helper = NeverBlock.spawn { Thread::Queue.new.pop }
        helper_line = __LINE__ - 1
        wait_line = __LINE__ + 1
        helper.wait
      end
    end
    assert_match(/\ASuite#test_hangs timed out after 0\.2 s; live fibers:/, error.message)
    assert_includes error.message, "(#{__FILE__}:#{helper_line})>", "names the helper task by where it was spawned"
    # Ruby 3.1 names the frame `pop'; 3.3 implements Queue#pop in Ruby and names the block
    assert_includes error.message, "#{__FILE__}:#{helper_line}:in ", "the helper's backtrace"
    assert_includes error.message, "#{__FILE__}:#{wait_line}:in", "the test body's backtrace"
    assert_kind_of Testing::Failure, error
    assert_kind_of NeverBlock::Error, error
  end

  def test_timeout_cancels_the_tasks_and_runs_their_ensure_blocks
    cleaned = []
    helper = nil
    assert_raises(Testing::TimeoutFailure) do
      Testing.run(timeout: 0.1) do
        helper = NeverBlock.spawn do
          sleep
        ensure
          cleaned << :helper
        end
        begin
          sleep
        ensure
          cleaned << :body
        end
      end
    end
    assert_equal %i[body helper], cleaned.sort
    assert_predicate helper, :cancelled?
  end

  def test_timeout_fires_on_the_timeout_not_long_after
    took = elapsed { assert_raises(Testing::TimeoutFailure) { Testing.run(timeout: 0.1) { sleep } } }
    assert_operator took, :<, 5
  end

  def test_leaked_task_fails_the_test_and_is_cancelled
    cleaned = false
    leaked = leaked_line = nil
    error = assert_raises(Testing::LeakedTasks) do
      Testing.run(timeout: 30, label: "Suite#test_leaks") do
        leaked_line = __LINE__ + 1
        leaked = NeverBlock.spawn do
          sleep 5
        ensure
          cleaned = true
        end
        :body_done
      end
    end
    assert_match(/\ASuite#test_leaks left 1 task\(s\) running; wait for or cancel them:/, error.message)
    assert_includes error.message, "(#{__FILE__}:#{leaked_line})>"
    assert_match(/#{TestSupport.frame('sleep')}/, error.message, "shows where the leaked task is")
    assert_predicate leaked, :cancelled?
    assert cleaned, "the leaked task's ensure block ran"
  end

  def test_leak_is_reported_when_the_test_ends_not_at_its_timeout
    took = elapsed do
      assert_raises(Testing::LeakedTasks) { Testing.run(timeout: 30) { NeverBlock.spawn { sleep 5 } } }
    end
    assert_operator took, :<, 3, "reported before the leaked task (5 s) or the timeout (30 s) could end"
  end

  def test_tasks_the_test_waited_for_are_not_leaks
    value = Testing.run(timeout: 5) do
      tasks = Array.new(3) { |i| NeverBlock.spawn { sleep 0.001; i } }
      NeverBlock.wait_all(tasks)
    end
    assert_equal [0, 1, 2], value
  end

  def test_the_bodys_own_exception_wins_over_a_leak
    leaked = nil
    log = capture_log do
      error = assert_raises(RuntimeError) do
        Testing.run(timeout: 30) do
          leaked = NeverBlock.spawn { sleep }
          raise "the test's own failure"
        end
      end
      assert_equal "the test's own failure", error.message
    end
    assert_predicate leaked, :cancelled?
    assert_empty log, "the failure is raised to the test, not also logged as unhandled"
  end

  def test_the_bodys_exception_is_raised_unchanged
    error_class = Class.new(StandardError)
    log = capture_log do
      assert_raises(error_class) { Testing.run(timeout: 5) { raise error_class, "boom" } }
    end
    assert_empty log
  end

  def test_leaked_pipe_fails_with_leaked_descriptors_listing_it
    reader = writer = nil
    error = assert_raises(Testing::LeakedDescriptors) do
      Testing.run(timeout: 5, label: "Suite#test_pipe") { reader, writer = IO.pipe }
    end
    assert_match(/\ASuite#test_pipe left 2 file descriptor\(s\) open; close them:/, error.message)
    assert_match(/fd #{reader.fileno} -> pipe:\[\d+\]/, error.message)
    assert_match(/fd #{writer.fileno} -> pipe:\[\d+\]/, error.message)
  ensure
    reader&.close
    writer&.close
  end

  def test_leaked_socket_fails_with_leaked_descriptors_listing_it
    server = nil
    error = assert_raises(Testing::LeakedDescriptors) do
      Testing.run(timeout: 5) { server = TCPServer.new("127.0.0.1", 0) }
    end
    assert_match(/fd #{server.fileno} -> socket:\[\d+\]/, error.message)
  ensure
    server&.close
  end

  def test_descriptors_closed_by_the_test_are_not_leaks
    value = Testing.run(timeout: 5) do
      TCPServer.open("127.0.0.1", 0) do |server|
        client = TCPSocket.new("127.0.0.1", server.addr[1])
        accepted = server.accept
        client.write("ping")
        accepted.read(4)
      ensure
        client&.close
        accepted&.close
      end
    end
    assert_equal "ping", value
  end

  def test_descriptor_check_can_be_turned_off
    reader = writer = nil
    assert_equal :ok, Testing.run(timeout: 5, check_descriptors: false) { reader, writer = IO.pipe; :ok }
  ensure
    reader&.close
    writer&.close
  end

  def test_open_descriptors_maps_each_fd_to_what_it_points_at
    skip "needs /proc/self/fd" unless File.directory?("/proc/self/fd")

    IO.pipe do |reader, _writer|
      assert_match(/\Apipe:\[\d+\]\z/, Testing.open_descriptors.fetch(reader.fileno))
    end
  end

  def test_rejects_a_bad_timeout_before_running_the_body
    ran = false
    [-1, Float::NAN, Float::INFINITY, "1"].each do |timeout|
      assert_raises(ArgumentError, timeout.inspect) { Testing.run(timeout: timeout) { ran = true } }
    end
    refute ran
  end

  def test_default_timeout_is_ten_seconds_or_neverblock_test_timeout
    code = 'require "neverblock/testing"; p NeverBlock::Testing.default_timeout'
    out, = ruby_child("-e", code, env: { "NEVERBLOCK_TEST_TIMEOUT" => nil })
    assert_equal "10.0", out.strip
    out, = ruby_child("-e", code, env: { "NEVERBLOCK_TEST_TIMEOUT" => "0.25" })
    assert_equal "0.25", out.strip
  end
end
