# frozen_string_literal: true

module NeverBlock
  module ActiveRecord
    # Gives back, as a NeverBlock task ends, the ActiveRecord connections
    # its fiber leased and left leased, as Rails' executor does at the end
    # of a request or a job.
    #
    # At the `:fiber` isolation level every fiber that asks for a connection
    # outside `with_connection` (`Model.connection`, `lease_connection`, a
    # gem that calls either) leases its own, and keeps it until something
    # releases it. A request's fiber has Rails' executor for that; a task
    # the app spawns (`NeverBlock.spawn`, an ActionController::Live action,
    # which runs as a task) had nothing: its connection stayed checked out
    # under a fiber that had ended, until ActiveRecord's reaper or an
    # exhausted pool took it back, so each such task opened a connection to
    # the database of its own (six Live streams one after another, six
    # backends), and a pooled fiber, reused, carried its last task's
    # connection into the next task.
    #
    # A lease records its pool on the leasing Fiber object ({Marking},
    # prepended to ActiveRecord's ConnectionPool): not in a fiber-local,
    # which Rails' Live copies from the request's fiber into the action's
    # and clears at the action's end. A task whose fiber recorded one
    # releases its connections in those pools as it ends
    # ({NeverBlock::Task.at_block_end}); others pay one instance-variable
    # read. Like the executor, it leaves a connection whose transaction is
    # still open, and it does nothing at the `:thread` level, where a lease
    # is the thread's, shared by every fiber on it.
    module TaskLeases
      # The Fiber's instance variable that holds the pools it leased from:
      # one, or an Array of several.
      POOLS = :@__neverblock_active_record_leased

      # Records the pool a fiber leases from.
      module Marking
        # ActiveRecord 7.2+'s permanent checkout (`ActiveRecord::Base.connection`
        # calls it).
        def lease_connection(*, **)
          TaskLeases.leased(self)
          super
        end
      end

      # The same, for ActiveRecord before 7.2, whose pool's `connection` leases.
      module MarkingBefore72
        def connection(*, **)
          TaskLeases.leased(self)
          super
        end
      end

      class << self
        # Marks leases and releases them at each task's end.
        # @return [void]
        def install
          pool = ::ActiveRecord::ConnectionAdapters::ConnectionPool
          marking = pool.method_defined?(:lease_connection) ? Marking : MarkingBefore72
          pool.prepend(marking) unless pool < marking
          Task.at_block_end(self)
        end

        # @api private
        # Records that the current fiber leases from `pool`.
        # @param pool [ActiveRecord::ConnectionAdapters::ConnectionPool]
        # @return [void]
        def leased(pool)
          fiber = Fiber.current
          pools = fiber.instance_variable_get(POOLS)
          if pools.nil?
            fiber.instance_variable_set(POOLS, pool)
          elsif pools.is_a?(Array)
            pools << pool unless pools.include?(pool)
          elsif !pools.equal?(pool)
            fiber.instance_variable_set(POOLS, [pools, pool])
          end
        end

        # In the fiber of a task that is ending: releases its connection in
        # each pool it leased from, unless a transaction is open on it. A
        # pool that fails is logged and the others are still released; a
        # cancellation or timeout arriving meanwhile propagates.
        # @return [void]
        def call
          fiber = Fiber.current
          pools = fiber.instance_variable_get(POOLS) or return

          fiber.instance_variable_set(POOLS, nil)
          return unless ::ActiveSupport::IsolatedExecutionState.isolation_level == :fiber

          pools.is_a?(Array) ? pools.each { |pool| release(pool) } : release(pools)
        end

        private

        def release(pool)
          return if pool.respond_to?(:discarded?) && pool.discarded? # a forked child's, or one disconnected

          connection = pool.active_connection? or return
          transaction = connection.current_transaction
          pool.release_connection if transaction.closed? || !transaction.joinable?
        rescue *INTERRUPTIONS
          raise
        rescue StandardError => e
          NeverBlock.logger.warn("NeverBlock") do
            "giving back the ActiveRecord connection an ending task leased failed: #{e.class}: #{e.message}"
          end
        end
      end
    end
  end
end
