# frozen_string_literal: true

module NeverBlock
  class Server
    # What a serving {Server} tells about itself, included in it: {#stats}
    # (the status endpoint, the control listener's /stats, `neverblock ctl
    # stats`), the counters behind /metrics ({Metrics}, set in a worker
    # whose master has a control listener) and {#task_dump} (QUIT, the
    # watchdog, /tasks). Read from the loop, and {#task_dump} from any
    # thread; nothing here changes what the server does.
    module Introspection
      # In a worker (or with `workers: 0`): this process's connections,
      # requests, fiber pool and the database pools that have connections
      # ({ConnectionPool.active}). In the master of a {Cluster}: its workers.
      # `connections` are open ones (at most `max_connections`), of which
      # `idle_connections` wait for their next request's first bytes;
      # `requests_in_flight` are in the app or having their response
      # written, `streams_open` of them having a streamed body written (an
      # event stream, a Live action's); `requests_timed_out` outlived
      # `request_timeout`;
      # `requests_hung_up` were cancelled as their client hung up ({HangupWatch});
      # `handed_off` counts the connections this worker moved to a less busy
      # sibling ({Handoff});
      # `fiber_pool` is `{size:, limit:, busy:, queued:}`: the `fiber_pool` request slots, how many of them may be taken now (the
      # adaptive limit, else `size`), those taken (from the end of a
      # request's head to its response's end) and the complete heads waiting
      # for one; `adaptive_limit` is {ConcurrencyLimit#stats} (nil when
      # disabled); and `connection_fibers` is {FiberPool#stats} of the
      # connections' fibers. The last keys are {RailsIntegration.server_stats}.
      # @return [Hash] `{pid:, worker:, connections:, idle_connections:,
      #   requests_in_flight:, streams_open:, requests_total:, requests_timed_out:, requests_hung_up:, handed_off:, fiber_pool:, adaptive_limit:, connection_fibers:,
      #   database_pools:, active_record_pools:}` (connection_fibers nil when
      #   not running); or {Cluster#stats} in the master.
      def stats
        return @cluster.stats if @cluster

        connections = @acceptor.connections
        { pid: Process.pid, worker: @worker_index, connections: connections.size,
          idle_connections: connections.each_key.count(&:idle?),
          requests_in_flight: @context.requests_in_flight, streams_open: @context.streams_open,
          requests_total: @context.requests_total,
          requests_timed_out: @context.requests_timed_out, requests_hung_up: @context.requests_hung_up,
          handed_off: @context.handed_off,
          **@admission.stats,
          connection_fibers: @acceptor.pool&.stats,
          database_pools: ConnectionPool.active.map { |pool| { name: pool.name, **pool.stats } },
          **RailsIntegration.server_stats }
      end

      # @api private
      # @return [Integer] requests started so far in this process.
      def requests_total
        @context.requests_total
      end

      # @api private
      # A worker whose master serves `/metrics` counts its requests
      # ({Metrics}); set before {#serve_here}.
      # @param metrics [Metrics]
      def metrics=(metrics)
        @metrics = metrics
        @context.metrics = metrics
        @admission.metrics = metrics
      end

      # @api private
      # @return [Hash, nil] {Metrics#snapshot} (nil without metrics).
      def metrics_snapshot
        @metrics&.snapshot(stats, @scheduler)
      end

      # What this process's tasks are doing, by kind: requests in flight,
      # children, detached tasks, each with where it comes from and its
      # backtrace, and the one holding the loop ({TaskDump}). Safe from any
      # thread; meant for one other than the loop's, which may be stuck.
      # @return [String] several lines; one saying so when not serving.
      def task_dump
        scheduler = @scheduler
        unless scheduler && !@wake_reader.closed?
          return "not serving (yet); the main thread is here:\n    #{(Thread.main.backtrace || []).first(TaskDump::FRAMES).join("\n    ")}"
        end

        TaskDump.new(scheduler, @acceptor.connections.keys, @serving_task).to_s
      end

      # @api private
      # Logs {#task_dump} from a thread of its own (a signal handler may not
      # take the logger's lock, and the loop may be stuck), then calls `after`
      # there.
      # @return [Thread]
      def log_task_dump(after = nil)
        Thread.new do
          NeverBlock.logger.warn { "NeverBlock::Server: #{@worker_index ? "worker #{@worker_index} " : ''}(pid #{Process.pid}) tasks:\n#{task_dump}" }
        ensure
          after&.call
        end
      end
    end
  end
end
