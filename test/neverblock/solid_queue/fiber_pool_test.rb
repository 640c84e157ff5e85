# frozen_string_literal: true

require_relative "../../test_helper"

# NeverBlock::SolidQueue::FiberPool keeps Solid Queue's pool contract
# (SolidQueue::Pool#post takes anything that responds to #perform), as Solid
# Queue's own pool tests use it (bin/solid-queue-suite runs them). Each in a
# child Ruby: Solid Queue and Rails stay out of this process. A claimed
# job's label and release are tested with a real bin/jobs in
# test/neverblock/solid_queue_test.rb.
class SolidQueueFiberPoolContractTest < PlainTest
  POOL = <<~RUBY
    require "rails"
    require "active_record"
    require "solid_queue"
    require "neverblock/solid_queue"
    STARTED = Thread::Queue.new
    Execution = Struct.new(:results, :pause) do
      def perform
        STARTED << true
        sleep(pause) if pause
        results << NeverBlock.current_task.label
      end
    end
    results = Thread::Queue.new
    pool = SolidQueue::Pool.build(type: :fiber, size: 2)
  RUBY

  def setup
    super
    skip "solid_queue needs Ruby 3.2+: it is in the Ruby 3.3 and 3.4 bundles only" unless solid_queue_in_bundle?
  end

  def test_an_execution_that_only_responds_to_perform_runs_as_a_task_named_by_its_class
    output = pool_child(<<~RUBY)
      2.times { pool.post(Execution.new(results, 0.05)) }
      2.times { puts results.pop(timeout: 10) }
      pool.shutdown
      puts pool.wait_for_termination(10)
    RUBY
    assert_equal ["Solid Queue execution (Execution)"] * 2 + ["true"], output.lines(chomp: true)
  end

  def test_an_execution_still_running_at_the_end_of_the_shutdown_timeout_is_cancelled
    output = pool_child(<<~RUBY)
      pool.post(Execution.new(results, 60))
      STARTED.pop(timeout: 10)
      pool.shutdown
      started = NeverBlock::Clock.now
      puts pool.wait_for_termination(1.0)
      puts NeverBlock::SolidQueue.stats[:cancelled]
      puts NeverBlock::Clock.now - started < 5
    RUBY
    assert_equal %w[true 1 true], output.lines(chomp: true)
  end

  private

  def solid_queue_in_bundle?
    defined?(Bundler) && Bundler.locked_gems.specs.any? { |spec| spec.name == "solid_queue" }
  end

  def pool_child(code)
    out, err, status = ruby_child("-e", POOL + code, timeout: 60)
    assert status.success?, "#{out}\n#{err}"
    out
  end
end
