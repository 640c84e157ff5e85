# frozen_string_literal: true

module NeverBlock
  class Server
    # What a serving process counts for its master's `/metrics` ({Cluster::Control}):
    # requests by method and status class, request durations and admission
    # waits (histograms), and the event loop's lag (a probe task wakes every
    # {PROBE_INTERVAL} and measures how late). {#snapshot} adds the gauges
    # read at that moment (requests in flight and waiting, the adaptive
    # limit, tasks, connections, database pools, GC); a worker sends one to
    # its master with each heartbeat ({Cluster::Worker}).
    #
    # Only made when the master has a control listener (`control:`), so a
    # server without one pays nothing on its request path. Loop only.
    class Metrics
      # Upper bounds (seconds) of the histograms' buckets; Prometheus's
      # `le` labels. The last bucket, +Inf, is implied.
      BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0].freeze

      # Seconds between two loop-lag probes.
      PROBE_INTERVAL = 0.1

      # Methods counted by name; any other counts as "other" (a client
      # inventing methods must not grow the series without bound).
      METHODS = %w[GET HEAD POST PUT PATCH DELETE OPTIONS].to_h { |name| [name, name] }.freeze

      # Counts of observations per bucket, their sum and count.
      class Histogram
        def initialize
          @counts = Array.new(BUCKETS.size + 1, 0)
          @sum = 0.0
          @count = 0
        end

        # @param seconds [Float]
        # @return [void]
        def observe(seconds)
          index = 0
          index += 1 while index < BUCKETS.size && seconds > BUCKETS[index]
          @counts[index] += 1
          @sum += seconds
          @count += 1
        end

        # @return [Hash] `{counts:, sum:, count:}`: counts per bucket, not cumulative.
        def to_h
          { counts: @counts.dup, sum: @sum, count: @count }
        end
      end

      # Made in the process that counts (a worker, after its fork): GC runs
      # and time are counted from here, not from the process's start, which
      # would count again those of the master or mold it was forked from.
      def initialize
        @gc_base = GC.stat.slice(:count, :major_gc_count, :time)
        @requests = Hash.new(0) # "GET 2xx" => count
        @durations = Histogram.new
        @admission_waits = Histogram.new
        @loop_lag = Histogram.new
      end

      # A request's response was written (or given up on).
      # @param method [String] REQUEST_METHOD.
      # @param status [Integer, nil] nil when the app raised and no response went out.
      # @param seconds [Float] from the end of its head to the end of its response.
      # @return [void]
      def request(method, status, seconds)
        @requests["#{METHODS.fetch(method, 'other')} #{status ? "#{status / 100}xx" : 'none'}"] += 1
        @durations.observe(seconds)
      end

      # A request got its slot after `seconds` (0 when one was free).
      # @return [void]
      def admitted(seconds)
        @admission_waits.observe(seconds)
      end

      # The probe task: runs until cancelled.
      # @return [void]
      def probe_loop_lag
        loop do
          started = Clock.now
          NeverBlock.sleep(PROBE_INTERVAL)
          @loop_lag.observe([Clock.now - started - PROBE_INTERVAL, 0.0].max)
        end
      end

      # @param stats [Hash] {Server#stats} of this process.
      # @param scheduler [Scheduler] its loop's.
      # @return [Hash] the counters and histograms, with the gauges of `stats`.
      def snapshot(stats, scheduler)
        pool = stats[:fiber_pool]
        limit = stats[:adaptive_limit]
        gc = GC.stat
        { requests: @requests.dup, request_duration: @durations.to_h, admission_wait: @admission_waits.to_h,
          loop_lag: @loop_lag.to_h, requests_in_flight: stats[:requests_in_flight], requests_waiting: pool[:queued],
          requests_total: stats[:requests_total], requests_timed_out: stats[:requests_timed_out],
          requests_hung_up: stats[:requests_hung_up], slots: pool[:size], slots_busy: pool[:busy], slots_limit: pool[:limit],
          adaptive_lag: limit && limit[:lag], connections: stats[:connections], idle_connections: stats[:idle_connections],
          tasks: scheduler.tasks.size, stalls: scheduler.stalls,
          database_pools: ConnectionPool.active.map { |db| { name: db.name, **db.stats, timeouts: db.timeouts, cancels: db.cancels } },
          gc_count: gc[:count] - @gc_base[:count], gc_major: gc[:major_gc_count] - @gc_base[:major_gc_count],
          gc_time: gc[:time] && gc[:time] - @gc_base[:time].to_i }
      end
    end
  end
end
