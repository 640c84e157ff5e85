# frozen_string_literal: true

require "neverblock"
require "solid_queue" unless defined?(::SolidQueue)
require_relative "solid_queue/job_counts"
require_relative "solid_queue/report"
require_relative "solid_queue/fiber_pool"
require_relative "solid_queue/seam"

module NeverBlock
  # Solid Queue's fiber workers (`fibers: N` in config/queue.yml) on
  # NeverBlock's event loop instead of an `async` reactor: each claimed job
  # runs as a NeverBlock task ({FiberPool}), so the stall detector, the
  # task tree (a job's spawned tasks end with it) and cancellation down to
  # the database query reach jobs too, and the `async` gem is not needed.
  #
  # Loaded by NeverBlock's Railtie once Solid Queue loads (its `:solid_queue`
  # load hook); outside Rails, `require "neverblock/solid_queue"` after
  # Solid Queue. Workers configured with `threads:` are left as they are.
  module SolidQueue
    # What this process's fiber workers counted of their jobs since it
    # started: for a `bin/jobs` that no NeverBlock server supervises (one
    # that is supervised also shows them in the server's `/metrics`). Call
    # it in the worker process (a job, or a thread started in Solid Queue's
    # `on_worker_start`); Solid Queue's supervisor, which runs no jobs,
    # reads zeros.
    #
    # `running` are the jobs in `perform` now; `succeeded`, `failed` and
    # `cancelled` count those ended so ({JobCounts}; `cancelled` are the
    # jobs still running at the end of the shutdown timeout, released for
    # another worker); `duration` is a histogram of their times: `counts`
    # per bucket (not cumulative) for the upper bounds in `buckets`
    # (seconds) and one more above them, their `sum` (seconds) and `count`.
    #
    # @return [Hash] `{running:, succeeded:, failed:, cancelled:,
    #   duration: {buckets:, counts:, sum:, count:}}`, summed over the
    #   process's fiber workers.
    def self.stats
      JobCounts.sum(FiberPool.all.map { |pool| pool.counts.to_h })
    end
  end
end

NeverBlock::SolidQueue::Seam.install
