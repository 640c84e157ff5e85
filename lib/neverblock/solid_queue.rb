# frozen_string_literal: true

require "neverblock"
require "solid_queue" unless defined?(::SolidQueue)
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
  end
end

NeverBlock::SolidQueue::Seam.install
