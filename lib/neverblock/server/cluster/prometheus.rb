# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # The cluster's metrics in Prometheus's text exposition format
      # (version 0.0.4), for {Control}'s `GET /metrics`: series labelled
      # `worker` (its index), gauges from each worker's last
      # {Metrics#snapshot}, counters and histograms from {Counters} (what
      # every worker that held the index counted: they only grow, across
      # restarts), its RSS read by the master from /proc, and the master's
      # own counts (workers, restarts by cause, supervised commands), and the
      # jobs of the supervised commands' Solid Queue fiber workers
      # ({JobMetrics}: no `worker` label, they are not the server's workers).
      # Counters end in `_total`; histograms have cumulative
      # `_bucket{le=...}`, `_sum` and `_count`.
      module Prometheus
        # name => [type, help]: every family, in the order written.
        FAMILIES = {
          "neverblock_workers" => ["gauge", "Workers the master runs."],
          "neverblock_worker_up" => ["gauge", "1 while the worker's loop sends heartbeats."],
          "neverblock_worker_restarts_total" => ["counter", "Workers replaced, by cause."],
          "neverblock_hot_restarts_total" => ["counter", "Hot restarts (HUP) of the master."],
          "neverblock_reforks_total" => ["counter", "Generations of workers forked from a warmed-up worker (refork)."],
          "neverblock_resident_memory_bytes" => ["gauge", "A worker's resident memory (RSS)."],
          "neverblock_requests_total" => ["counter", "Requests answered, by method and status class."],
          "neverblock_request_timeouts_total" => ["counter", "Requests that outlived request_timeout (answered 503, or by the app)."],
          "neverblock_client_hangups_total" => ["counter", "Requests cancelled because their client hung up (logged 499)."],
          "neverblock_request_duration_seconds" => ["histogram", "From a request's complete head to its response's end."],
          "neverblock_admission_wait_seconds" => ["histogram", "Time a request waited for a request slot."],
          "neverblock_loop_lag_seconds" => ["histogram", "How late the event loop woke a 0.1 s timer."],
          "neverblock_requests_in_flight" => ["gauge", "Requests in the app or having their response written."],
          "neverblock_requests_waiting" => ["gauge", "Complete requests waiting for a slot."],
          "neverblock_request_slots" => ["gauge", "Request slots (fiber_pool)."],
          "neverblock_request_slots_busy" => ["gauge", "Request slots taken."],
          "neverblock_adaptive_limit" => ["gauge", "Slots the adaptive limit allows now."],
          "neverblock_adaptive_limit_lag_seconds" => ["gauge", "The loop lag the adaptive limit last decided on."],
          "neverblock_connections" => ["gauge", "Open client connections."],
          "neverblock_idle_connections" => ["gauge", "Keep-alive connections waiting for a request."],
          "neverblock_tasks" => ["gauge", "Tasks alive on the worker's loop."],
          "neverblock_stalls_total" => ["counter", "Times one fiber held the loop past the stall threshold."],
          "neverblock_db_pool_size" => ["gauge", "Connections a database pool may open."],
          "neverblock_db_pool_in_use" => ["gauge", "Connections checked out."],
          "neverblock_db_pool_idle" => ["gauge", "Open connections not checked out."],
          "neverblock_db_pool_waiting" => ["gauge", "Callers waiting for a connection."],
          "neverblock_db_pool_checkout_timeouts_total" => ["counter", "Checkouts that timed out."],
          "neverblock_db_pool_query_cancels_total" => ["counter", "Queries cancelled on the server (timeouts, cancelled tasks)."],
          "neverblock_gc_runs_total" => ["counter", "GC runs."],
          "neverblock_gc_major_runs_total" => ["counter", "Major GC runs."],
          "neverblock_gc_seconds_total" => ["counter", "Time spent in GC."],
          "neverblock_supervised_restarts_total" => ["counter", "Restarts of a supervised command."],
          "neverblock_jobs_running" => ["gauge", "Solid Queue jobs in perform now, in the fiber workers of supervised commands."],
          "neverblock_jobs_total" => ["counter", "Solid Queue jobs ended in those workers, by outcome (cancelled: released at shutdown)."],
          "neverblock_job_duration_seconds" => ["histogram", "A Solid Queue job's time in perform, in those workers."]
        }.freeze

        module_function

        # @param cluster [Cluster]
        # @return [String]
        def render(cluster)
          series = Hash.new { |hash, key| hash[key] = [] }
          workers = cluster.children.reject(&:stopping).sort_by(&:index)
          series["neverblock_workers"] << [{}, workers.size]
          cluster.restarts.each { |cause, count| series["neverblock_worker_restarts_total"] << [{ cause: cause }, count] }
          stats = cluster.stats
          series["neverblock_hot_restarts_total"] << [{}, stats[:hot_restarts]]
          series["neverblock_reforks_total"] << [{}, stats[:reforks]]
          stats[:supervised].each do |sidecar|
            series["neverblock_supervised_restarts_total"] << [{ command: sidecar[:command] }, sidecar[:restarts]]
          end
          add_jobs(series, cluster.job_metrics&.read)
          stale = cluster.settings.heartbeat_interval * 3
          counters = cluster.counters
          counted = counters.indexes
          (workers.map(&:index) | counted).sort.each do |index|
            labels = { worker: index }
            # (during a restart the new worker and the old share the index: the one that accepts speaks)
            sharing = workers.select { |each| each.index == index }
            worker = sharing.find(&:ready) || sharing.first
            if worker
              up = worker.ready && worker.beat_at && Clock.now - worker.beat_at <= stale
              series["neverblock_worker_up"] << [labels, up ? 1 : 0]
              rss = Memory.of(worker.pid, :rss)
              series["neverblock_resident_memory_bytes"] << [labels, rss] if rss
              add_gauges(series, labels, worker.metrics) if worker.metrics
            end
            add_counters(series, labels, counters.totals(index)) if counted.include?(index)
          end
          FAMILIES.filter_map do |name, (type, help)|
            next if series[name].empty?

            ["# HELP #{name} #{help}", "# TYPE #{name} #{type}", *series[name].flat_map { |labels, value| lines(name, type, labels, value) }]
          end.flatten.join("\n") << "\n"
        end

        # The gauges of one worker's last {Metrics#snapshot}.
        def add_gauges(series, labels, metrics)
          { "neverblock_requests_in_flight" => "requests_in_flight", "neverblock_requests_waiting" => "requests_waiting",
            "neverblock_request_slots" => "slots", "neverblock_request_slots_busy" => "slots_busy",
            "neverblock_adaptive_limit" => "slots_limit", "neverblock_adaptive_limit_lag_seconds" => "adaptive_lag",
            "neverblock_connections" => "connections", "neverblock_idle_connections" => "idle_connections",
            "neverblock_tasks" => "tasks" }.each do |name, key|
            series[name] << [labels, metrics[key]] unless metrics[key].nil?
          end
          metrics["database_pools"].each_with_index do |pool, position|
            pool_labels = labels.merge(pool: Counters.pool_name(pool, position))
            { "neverblock_db_pool_size" => "size", "neverblock_db_pool_in_use" => "in_use", "neverblock_db_pool_idle" => "idle",
              "neverblock_db_pool_waiting" => "waiting" }.each do |name, key|
              series[name] << [pool_labels, pool[key]]
            end
          end
        end

        # The counters and histograms of one worker index ({Counters#totals}).
        def add_counters(series, labels, totals)
          totals["requests"].each do |key, count|
            method, status = key.split(" ", 2)
            series["neverblock_requests_total"] << [labels.merge(method: method, status: status), count]
          end
          { "neverblock_request_duration_seconds" => "request_duration", "neverblock_admission_wait_seconds" => "admission_wait",
            "neverblock_loop_lag_seconds" => "loop_lag" }.each { |name, key| series[name] << [labels, totals[key]] if totals[key] }
          { "neverblock_stalls_total" => "stalls", "neverblock_gc_runs_total" => "gc_count",
            "neverblock_gc_major_runs_total" => "gc_major", "neverblock_request_timeouts_total" => "requests_timed_out",
            "neverblock_client_hangups_total" => "requests_hung_up" }.each do |name, key|
            series[name] << [labels, totals[key]] if totals[key]
          end
          series["neverblock_gc_seconds_total"] << [labels, totals["gc_time"] / 1000.0] if totals["gc_time"]
          totals["database_pools"].each do |pool, counts|
            { "neverblock_db_pool_checkout_timeouts_total" => "timeouts", "neverblock_db_pool_query_cancels_total" => "cancels" }.each do |name, key|
              series[name] << [labels.merge(pool: pool), counts[key]] if counts[key]
            end
          end
        end

        # The jobs of the supervised commands ({JobMetrics#read}; nil: none yet).
        def add_jobs(series, jobs)
          return unless jobs

          series["neverblock_jobs_running"] << [{}, jobs[:running]]
          JobMetrics::OUTCOMES.each { |outcome| series["neverblock_jobs_total"] << [{ outcome: outcome }, jobs[outcome.to_sym]] }
          series["neverblock_job_duration_seconds"] << [{}, jobs[:duration].transform_keys(&:to_s)]
        end

        def lines(name, type, labels, value)
          return ["#{name}#{label_text(labels)} #{number(value)}"] unless type == "histogram"

          bounds = value["buckets"] || Metrics::BUCKETS # a job histogram's own, else the server's
          cumulative = 0
          buckets = value["counts"].each_with_index.map do |count, index|
            cumulative += count
            le = index < bounds.size ? number(bounds[index]) : "+Inf"
            "#{name}_bucket#{label_text(labels.merge(le: le))} #{cumulative}"
          end
          buckets + ["#{name}_sum#{label_text(labels)} #{number(value['sum'])}",
                     "#{name}_count#{label_text(labels)} #{value['count']}"]
        end

        def label_text(labels)
          return "" if labels.empty?

          "{#{labels.map { |key, value| %(#{key}="#{escape(value)}") }.join(',')}}"
        end

        # Label values escape backslash, double quote and newline.
        def escape(value)
          value.to_s.gsub("\\", "\\\\\\\\").gsub('"', '\\"').gsub("\n", "\\n")
        end

        def number(value)
          value.is_a?(Float) ? value.to_s.sub(/\.0\z/, "") : value.to_s
        end
      end
    end
  end
end
