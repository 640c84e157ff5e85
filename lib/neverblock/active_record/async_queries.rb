# frozen_string_literal: true

module NeverBlock
  module ActiveRecord
    # `load_async` (and `async_count`, `async_pluck`, `async_find_by_sql`...)
    # on NeverBlock's fibers instead of ActiveRecord's executor threads.
    #
    # With `config.active_record.async_query_executor = :global_thread_pool`
    # (or `:multi_thread_pool`), ActiveRecord runs an async query by posting
    # it to a thread pool. Called from a NeverBlock fiber (a request of
    # NeverBlock::Server, a task), the query runs instead in a task spawned
    # there, on a connection of its own: concurrent without a thread, and a
    # child of the request's task (Task::Tree), so it is cancelled with the
    # request (request_timeout, a client that hung up) and its query
    # cancelled on the database server. Elsewhere (a Sidekiq thread, the
    # console) ActiveRecord's executor runs it as before.
    #
    # Reading the relation waits for its task's result, or runs the query
    # in the caller if it has not started (ActiveRecord's own FutureResult
    # logic). Prepended to ActiveRecord's ConnectionPool by {ActiveRecord.install}.
    module AsyncQueries
      # @api private
      # ActiveRecord's ConnectionPool#schedule_query.
      # @param future_result [::ActiveRecord::FutureResult]
      # @return [void]
      def schedule_query(future_result)
        return super unless NeverBlock.neverblocking?

        NeverBlock.spawn { future_result.execute_or_skip }
        nil
      end
    end
  end
end
