# frozen_string_literal: true

require_relative "../../test_helper"
require "action_controller"
require "action_dispatch/middleware/cookies" # Live commits its cookie jar
require "neverblock/server"
require "neverblock/rails_integration"

# RailsIntegration::LiveWrites::Queue with Rails' own Live::Buffer and
# Live::Response, on a loop, without a server: the consumer stands for the
# server's fiber in the body's `each`.
class LiveWritesQueueTest < PlainTest
  LiveWrites = NeverBlock::RailsIntegration::LiveWrites
  TimedOut = NeverBlock::Server::Response::WriteTimedOut

  def setup
    ActionController::Live::Buffer.prepend(LiveWrites::Buffer)
  end

  # A direct write that times out aborts the stream; the consumer, waiting
  # for the next chunk, must hear of it though the action ignores
  # disconnects and goes on writing (Rails 7.2's abort leaves its queue
  # open: the server's fiber would wait until the action closed the stream).
  def test_a_failed_direct_write_wakes_the_consumer_though_the_action_ignores_disconnects
    on_a_loop do |response, stream|
      stream.ignore_disconnect = true
      taken = 0
      consumer = NeverBlock.spawn do
        response.each do |_chunk|
          taken += 1
          raise TimedOut, "write timed out" if taken == 3 # a write straight from the action
        end
      end
      writes = 0
      writer = NeverBlock.spawn do
        loop do
          stream.write("data: #{writes += 1}\n\n")
          sleep 0.01
        end
      end
      error = NeverBlock.timeout(5) { assert_raises(TimedOut) { consumer.value } }
      assert_equal "write timed out", error.message
      refute stream.connected?, "the stream is aborted"
      sleep 0.05
      assert_operator writes, :>, taken, "the action wrote on, into nothing, without an error"
      writer.cancel
    end
  end

  # A direct write interrupted by its own fiber's cancel: the writer gets
  # its Cancelled; the consumer gets a WriteInterrupted (never the
  # writer's Cancelled, which would read as its own).
  def test_a_direct_write_interrupted_in_its_fiber_ends_the_consumer_with_write_interrupted
    on_a_loop do |response, stream|
      gate = Thread::Queue.new
      consumer = NeverBlock.spawn { response.each { |chunk| gate.pop if chunk == "slow\n" } }
      stream.write("first\n") # queued, or straight through: the consumer may not be in `each` yet
      sleep 0.05
      writer = NeverBlock.spawn { stream.write("slow\n") }
      sleep 0.05
      writer.cancel
      assert_raises(NeverBlock::Cancelled) { writer.value }
      error = NeverBlock.timeout(5) { assert_raises(LiveWrites::WriteInterrupted) { consumer.value } }
      assert_kind_of NeverBlock::Cancelled, error.cause
      assert_raises(ActionController::Live::ClientDisconnected) { stream.write("after\n") }
    end
  end

  # A timeout around a write that waits for a slow client is the writer's
  # (NeverBlock.timeout raises a RuntimeError inside its block): it gets
  # its TimeoutError, not ClientDisconnected, and the consumer a
  # WriteInterrupted.
  def test_a_timeout_around_a_direct_write_is_the_writers
    on_a_loop do |response, stream|
      gate = Thread::Queue.new
      consumer = NeverBlock.spawn { response.each { |chunk| gate.pop if chunk == "slow\n" } }
      sleep 0.05
      writer = NeverBlock.spawn { NeverBlock.timeout(0.1) { stream.write("slow\n") } }
      assert_raises(NeverBlock::TimeoutError) { writer.value }
      error = NeverBlock.timeout(5) { assert_raises(LiveWrites::WriteInterrupted) { consumer.value } }
      assert_kind_of NeverBlock::TimeoutError::Expired, error.cause
    end
  end

  # A writer waiting for another's direct write when that one fails finds
  # the stream aborted: under ignore_disconnect its write is dropped, as
  # Rails drops it, not a ClosedQueueError from the closed queue.
  def test_a_write_waiting_behind_a_failed_one_is_dropped_under_ignore_disconnect
    on_a_loop do |response, stream|
      stream.ignore_disconnect = true
      gate = Thread::Queue.new
      consumer = NeverBlock.spawn do
        response.each do |chunk|
          next unless chunk == "first\n"

          gate.pop
          raise TimedOut, "write timed out"
        end
      end
      sleep 0.05
      first = NeverBlock.spawn { stream.write("first\n") }
      second = NeverBlock.spawn { stream.write("second\n") }
      sleep 0.05
      gate << :fail
      first.value # (raises what the write raised)
      second.value
      refute stream.connected?
      NeverBlock.timeout(5) { assert_raises(TimedOut) { consumer.value } }
    end
  end

  # The queue is still Rails' SizedQueue to whoever queues on it: push's
  # non_block (and pop's) and, from Ruby 3.2, `timeout:` behave as Ruby's.
  def test_queued_pushes_and_pops_take_sized_queues_arguments
    queue = LiveWrites::Queue.new(1, nil, -> {})
    queue.push("a")
    assert_raises(ThreadError) { queue.push("b", true) } # full
    assert_equal "a", queue.pop(true)
    assert_raises(ThreadError) { queue.pop(true) } # empty
    return unless RUBY_VERSION >= "3.2"

    queue.push("c", timeout: 0)
    assert_nil queue.push("d", timeout: 0.01), "a push that timed out"
    assert_equal "c", queue.pop(timeout: 0)
    assert_nil queue.pop(timeout: 0.01)
  end

  # A write straight through makes no objects of the queue's: Rails'
  # Buffer#write calls `@buf.push(string)` for every chunk.
  def test_a_direct_write_allocates_nothing_in_the_queue
    on_a_loop do |response, stream|
      consumer = NeverBlock.spawn { response.each { |_chunk| nil } }
      stream.write("first\n")
      sleep 0.01 # the consumer is in `each`
      queue = stream.instance_variable_get(:@buf)
      assert_instance_of LiveWrites::Queue, queue
      chunk = "data: x\n\n"
      queue.push(chunk) # (warm)
      assert queue.send(:direct?), "the consumer takes writes straight through (else this counts the queued path)"
      before = GC.stat(:total_allocated_objects)
      100.times { queue.push(chunk) }
      assert_operator GC.stat(:total_allocated_objects) - before, :<, 10, "objects for 100 direct writes"
      stream.close
      consumer.value
    end
  end

  # Only the request's own tasks write straight through, however many
  # writes they made before: a write from a task outside the request
  # (another request broadcasting to this stream) is queued, for the
  # server's fiber to write, and so is none of its wait on this client.
  def test_a_write_from_outside_the_request_is_queued_after_its_own_went_straight_through
    NeverBlock.run do
      response, stream = live_response
      queue = nil
      request = NeverBlock.spawn do
        LiveWrites.enable(stream, NeverBlock.current_task)
        queue = stream.instance_variable_get(:@buf)
        consumer = NeverBlock.spawn { response.each { |_chunk| nil } }
        stream.write("first\n") # the server is not in `each` yet: queued
        sleep 0.01
        action = NeverBlock.spawn do
          3.times { stream.write("own\n") }
          queue.size
        end
        assert_equal 0, action.value, "the action's writes went straight through"
        consumer
      end
      consumer = request.value
      outside = NeverBlock.spawn do
        stream.write("outside\n")
        queue.size
      end
      assert_equal 1, outside.value, "a write from outside the request is queued"
      stream.close
      NeverBlock.timeout(5) { consumer.value }
    end
  end

  # Once committed, a Live response stays committed: a write after the
  # first does not commit it again (Rails' commit takes the response's
  # monitor and fetches the cookie jar on every write).
  def test_writes_after_the_first_do_not_commit_again
    ActionController::Live::Response.prepend(LiveWrites::Response)
    on_a_loop do |response, stream|
      commits = 0
      response.singleton_class.define_method(:before_committed) do # (Rails' hook run by each commit, 7.2 and 8.1)
        commits += 1
        super()
      end
      consumer = NeverBlock.spawn { response.each { |_chunk| nil } } # (Rails' `each` may commit)
      before = commits
      5.times { stream.write("data: x\n\n") }
      assert response.committed?
      assert_operator commits - before, :<=, 1, "commits for 5 writes"
      stream.close
      NeverBlock.timeout(5) { consumer.value }
    end
  end

  private

  # Yields, on a loop, a Live response and its stream, whose writes from
  # the loop's tasks go straight to the consumer.
  def on_a_loop
    NeverBlock.run do
      response, stream = live_response
      LiveWrites.enable(stream, NeverBlock.current_task)
      yield response, stream
    end
  end

  def live_response
    response = ActionController::Live::Response.new
    response.request = ActionDispatch::Request.new(Rack::MockRequest.env_for("/"))
    [response, response.stream]
  end
end
