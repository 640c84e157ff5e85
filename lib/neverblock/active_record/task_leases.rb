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
    # A lease marks the fiber ({Marking}, prepended to ActiveRecord's
    # ConnectionPool); a task whose fiber is marked releases its
    # connections as it ends ({NeverBlock::Task.at_block_end}). Others pay
    # one fiber-local read. Like the executor, it leaves a connection whose
    # transaction is still open, and it does nothing at the `:thread` level,
    # where a lease is the thread's, shared by every fiber on it.
    module TaskLeases
      # The fiber-local that marks a fiber holding a lease (NeverBlock's own
      # prefix: a Live action's fiber keeps its own, see RailsIntegration::Live).
      KEY = :__neverblock_active_record_leased

      # Marks the fiber that leases a connection.
      module Marking
        # ActiveRecord 7.2+'s permanent checkout (`ActiveRecord::Base.connection`
        # calls it).
        def lease_connection(*, **)
          Thread.current[KEY] = true
          super
        end
      end

      # The same, for ActiveRecord before 7.2, whose pool's `connection` leases.
      module MarkingBefore72
        def connection(*, **)
          Thread.current[KEY] = true
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

        # In the fiber of a task that is ending: if it leased a connection,
        # releases the connections it holds in every pool, each unless a
        # transaction is open on it.
        # @return [void]
        def call
          thread = Thread.current
          return unless thread[KEY]

          thread[KEY] = nil
          return unless ::ActiveSupport::IsolatedExecutionState.isolation_level == :fiber

          ::ActiveRecord::Base.connection_handler.each_connection_pool do |pool|
            connection = pool.active_connection? or next
            transaction = connection.current_transaction
            pool.release_connection if transaction.closed? || !transaction.joinable?
          end
        end
      end
    end
  end
end
