# frozen_string_literal: true

require_relative "../test_helper"
require_relative "../support/counting_upstream"
require "net/http"
require "socket"

begin
  require "active_job"
rescue LoadError
  nil # the Ruby 3.1 bundle has no activejob (it comes with solid_queue, Ruby 3.2+): the tests skip
end

# The recipe docs/rails.md gives for a job on a backend other than Solid
# Queue's fiber workers (Sidekiq's threads, ActiveJob's :async and :inline
# adapters): `perform` makes its calls at once with NeverBlock.map, which
# runs a loop of its own on the job's thread, or joins the NeverBlock loop
# the job is performed on. Real ActiveJob, real Net::HTTP calls to a local
# HTTP server that answers each after 1 s: twenty of them end in about a
# second, not twenty.
class ActiveJobRecipeTest < PlainTest
  CALLS = 20

  if defined?(ActiveJob::Base)
    # The job as docs/rails.md shows it: its calls at once, at most 20.
    class FetchAllJob < ActiveJob::Base
      # What each perform saw, for the test to read.
      RESULTS = Thread::Queue.new

      def perform(urls)
        started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        bodies = NeverBlock.map(urls, concurrency: 20) { |url| Net::HTTP.get(URI(url)) }
        RESULTS << { bodies: bodies, seconds: Process.clock_gettime(Process::CLOCK_MONOTONIC) - started,
                     thread: Thread.current, scheduler_after: Fiber.scheduler }
      end
    end
  end

  def setup
    super
    skip "activejob is in the Ruby 3.3 and 3.4 bundles only (it comes with solid_queue)" unless defined?(ActiveJob::Base)
    ActiveJob::Base.logger = Logger.new(nil)
    FetchAllJob::RESULTS.clear
    @upstream = CountingUpstream.new(hold: 1, http: true)
  end

  def teardown
    @upstream&.close
    super
  end

  # Sidekiq's processor threads, a console, a test: no loop on the thread.
  def test_perform_now_on_a_plain_thread_runs_its_calls_at_once
    FetchAllJob.perform_now(urls)
    result = FetchAllJob::RESULTS.pop(timeout: 30)

    assert_equal urls.map { |url| "answer to #{URI(url).path}" }, result[:bodies]
    assert_operator result[:seconds], :<, CALLS / 4.0, "twenty 1 s calls, at once (one after another: 20 s)"
    assert_equal CALLS, @upstream.most
    assert_nil result[:scheduler_after], "the loop NeverBlock.map ran is gone once perform returns"
  end

  # ActiveJob's :async adapter: perform_later runs the job on a thread of its pool.
  def test_the_async_adapter_runs_it_on_its_pool_thread_with_its_calls_at_once
    adapter = ActiveJob::QueueAdapters::AsyncAdapter.new
    FetchAllJob.queue_adapter = adapter
    FetchAllJob.perform_later(urls)
    result = FetchAllJob::RESULTS.pop(timeout: 30)

    refute_nil result, "performed within 30 s"
    refute_equal Thread.current, result[:thread]
    assert_equal CALLS, result[:bodies].size
    assert_operator result[:seconds], :<, CALLS / 4.0
    assert_equal CALLS, @upstream.most
  ensure
    adapter&.shutdown(wait: true)
  end

  # :inline (or perform_now) inside a NeverBlock loop, as in a request
  # under `neverblock serve`: the calls are tasks of that loop, and the
  # loop's other tasks run while the job waits.
  def test_performed_inside_a_neverblock_loop_it_joins_that_loop
    ticks = 0
    NeverBlock.run do
      ticker = NeverBlock.spawn do
        loop do
          sleep 0.05
          ticks += 1
        end
      end
      FetchAllJob.queue_adapter = :inline
      FetchAllJob.perform_later(urls)
      ticker.cancel
    end
    result = FetchAllJob::RESULTS.pop(timeout: 0)

    assert_equal CALLS, result[:bodies].size
    assert_operator result[:seconds], :<, CALLS / 4.0
    assert_equal CALLS, @upstream.most
    assert_operator ticks, :>=, 5, "the loop's other tasks ran while the job waited"
    assert_instance_of NeverBlock::Scheduler, result[:scheduler_after]
  end

  private

  # The upstream's URLs of CALLS calls, a path each.
  def urls
    Array.new(CALLS) { |n| "http://127.0.0.1:#{@upstream.port}/call/#{n}" }
  end
end
