# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # The master's watch over its workers, included in {Cluster} and run
      # on each turn of its loop ({Settings} has the knobs):
      #
      # - a worker whose loop has sent no heartbeat for `worker_timeout` (held
      #   by one fiber: `loop {}`, a C call holding the GVL, a deadlock) is
      #   asked for its task dump (QUIT), which names the request and shows
      #   where it is, and killed (KILL) once that is logged or after
      #   {DUMP_GRACE} seconds, then replaced; one that booted for longer
      #   than `worker_boot_timeout` without accepting is killed too;
      # - one that served `max_requests` (plus jitter) or uses more than
      #   `max_memory` is replaced gracefully: its successor boots first, as
      #   in a rolling restart, and only then is it stopped; one such
      #   replacement at a time, none during a rolling restart.
      module Watchdog
        # Seconds a hung worker gets to log its task dump before it is killed.
        DUMP_GRACE = 2

        # Seconds between two looks at the workers' memory (with `max_memory`).
        MEMORY_CHECK_INTERVAL = 1.0

        private

        # Each turn: a worker that booted for too long, or whose loop sent no
        # heartbeat for `worker_timeout`, is asked for its dump (and killed
        # after DUMP_GRACE); memory is looked at once a MEMORY_CHECK_INTERVAL.
        def watch_workers
          now = Clock.now
          @workers.each_value do |worker|
            next if worker.stopping || worker.promoting # (a promoted one is watched by Refork#watch_candidate)

            if worker.hung_at
              worker.kill_hung if now - worker.hung_at > DUMP_GRACE
            elsif (why = worker.overdue(now, @settings))
              worker.hang(why)
            end
          end
          check_memory(now) if @settings.max_memory && now - @memory_checked_at >= MEMORY_CHECK_INTERVAL
        end

        def check_memory(now)
          @memory_checked_at = now
          @workers.each_value do |worker|
            next unless worker.ready && !worker.stopping && !worker.retiring && !worker.hung_at

            used = Memory.of(worker.pid, @settings.memory_metric) or next
            retire(worker, :memory, used) if used > @settings.max_memory
          end
        end

        # Queues `worker` for a graceful replacement ({#continue_retiring}).
        def retire(worker, cause, used = nil)
          return if worker.retiring || worker.stopping || @stopping

          worker.retiring = cause
          @retiring << worker
          NeverBlock.logger.info do
            why = if cause == :memory
                    "uses #{Memory.mb(used)} MB of #{@settings.memory_metric.upcase}, over max_memory #{Memory.mb(@settings.max_memory)} MB"
                  else
                    "served #{worker.requests} requests (max_requests #{worker.max_requests})"
                  end
            queued = (@retiring - [worker]).first
            "NeverBlock::Server: #{worker} #{why}: replacing it, its successor first" \
              "#{"; after #{queued}'s replacement (one at a time)" if queued}"
          end
        end

        # One graceful replacement at a time, none during a rolling restart
        # (which replaces every worker anyway): start the successor (once the
        # worker replaced before has exited), and stop the old worker once the
        # successor accepts.
        def continue_retiring
          return unless @restart_queue.empty?

          @retiring.reject! { |worker| worker.stopping || !@workers.key?(worker.pid) }
          old = @retiring.first or return
          successor = @workers.each_value.find { |worker| worker.successor_of == old.pid }
          if successor.nil?
            # Not while the last one replaced is still on its way out: never more
            # than one process beyond the workers (memory is often why).
            return if @workers.each_value.any?(&:stopping)

            spawn_worker(old.index, successor_of: old.pid) if Clock.now >= @next_boot_at
          elsif successor.ready
            @restarts[old.retiring] += 1
            old.terminate
            @retiring.shift
          end
        end
      end
    end
  end
end
