# frozen_string_literal: true

module NeverBlock
  module SolidQueue
    # Where Solid Queue is told to use {FiberPool}. Solid Queue 1.7 picks a
    # worker's execution pool in `SolidQueue::Pool.build(type:, ...)` by the
    # constant name (`SolidQueue::FiberPool` for `fibers:`), and its
    # configuration check requires the `async` gem for fiber workers; it has
    # no setting for either. So this is two narrow prepends, and the only
    # ones: `Pool.build` builds NeverBlock's pool for `type: :fiber` (any
    # other type goes to Solid Queue unchanged), and the `async` check is
    # skipped, since NeverBlock's pool does not use `async`.
    module Seam
      # Prepended to `SolidQueue::Pool`'s singleton class.
      module PoolBuild
        # @return [SolidQueue::Pool] {FiberPool} for `type: :fiber`, else
        #   Solid Queue's own pool.
        def build(type:, size:, **callbacks)
          return super unless type.to_s == "fiber"

          NeverBlock::SolidQueue::FiberPool.new(size, **callbacks)
        end
      end

      # Prepended to `SolidQueue::Configuration`.
      module NoAsyncRequirement
        private

        # Solid Queue's check that fiber workers can `require "async"`:
        # NeverBlock's pool runs them without it.
        def ensure_fiber_workers_have_required_dependency; end
      end

      # Installs both prepends, once.
      # @return [void]
      def self.install
        return if ::SolidQueue::Pool.singleton_class.include?(PoolBuild)

        ::SolidQueue::Pool.singleton_class.prepend(PoolBuild)
        ::SolidQueue::Configuration.prepend(NoAsyncRequirement)
      end
    end
  end
end
