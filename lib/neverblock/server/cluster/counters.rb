# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # The cluster's counters, kept by the master so that each one only
      # grows, as Prometheus expects of a counter: a worker's own counts
      # start at 0 with its process, and a worker index is held by a new
      # process after every rolling restart, refork, recycling or crash. The
      # master adds up, per worker index, each report's increase over what the
      # same process reported before; what a worker counted is kept after it
      # exits, and carried into a new image on a hot restart ({#carried}).
      #
      # The counts are those of {Metrics#snapshot} (requests by method and
      # status class, timeouts, hang-ups, stalls, GC runs and time, the
      # histograms' buckets, sums and counts, each database pool's checkout
      # timeouts and query cancels) and the requests started that each
      # heartbeat carries ({#beat}). A count lower than the same process
      # reported before (which a process's own counters never are) is taken
      # as counting again from 0.
      #
      # Who calls it: {Child}, as each heartbeat's lines are read, and
      # {Cluster}'s reap ({#forget}), on the master's loop; {Prometheus} and
      # {Control} read it from the control listener's thread. Each change
      # replaces the frozen Hash a reader sees in one assignment: a reader
      # sees the counts before or after a report, never half of one.
      class Counters
        # Counts of a snapshot that are single numbers.
        SCALARS = %w[requests_timed_out requests_hung_up stalls gc_count gc_major gc_time].freeze
        # Histograms of a snapshot (each `{counts:, sum:, count:}`).
        HISTOGRAMS = %w[request_duration admission_wait loop_lag].freeze
        # Counts of each database pool in a snapshot.
        POOL_COUNTS = %w[timeouts cancels].freeze
        # The path of the requests started, from the heartbeats.
        STARTED = ["started"].freeze

        # @param carried [Hash, nil] {#carried} of a previous image (a hot
        #   restart); anything else is ignored.
        def initialize(carried = nil)
          @totals = {}.freeze # index => {path => count}, frozen
          @seen = {} # pid => {path => count}: what that process reported last (the master's loop only)
          restore(carried) if carried.is_a?(Hash)
        end

        # @param metrics [Hash] a {Metrics#snapshot} as the master parsed it (String keys).
        # @return [Hash{Array => Numeric}] its counts, by path (`["requests", "GET 2xx"]`,
        #   `["request_duration", "counts", 3]`, `["database_pools", "primary", "timeouts"]`).
        def self.counts(metrics)
          counts = {}
          (metrics["requests"] || {}).each { |key, count| counts[["requests", key]] = count }
          SCALARS.each { |key| counts[[key]] = metrics[key] if metrics[key].is_a?(Numeric) }
          HISTOGRAMS.each do |key|
            histogram = metrics[key] or next
            histogram["counts"].each_with_index { |count, bucket| counts[[key, "counts", bucket]] = count }
            counts[[key, "sum"]] = histogram["sum"]
            counts[[key, "count"]] = histogram["count"]
          end
          (metrics["database_pools"] || []).each_with_index do |pool, position|
            POOL_COUNTS.each do |key|
              counts[["database_pools", pool_name(pool, position), key]] = pool[key] if pool[key].is_a?(Numeric)
            end
          end
          counts
        end

        # @return [String] how /metrics labels a pool: its name, else its position.
        def self.pool_name(pool, position)
          pool["name"] || "pool#{position}"
        end

        # Worker `pid`, at `index`, has started `requests` requests.
        # @return [void]
        def beat(index, pid, requests)
          add(index, pid, { STARTED => requests })
        end

        # Worker `pid`, at `index`, sent `metrics` ({Metrics#snapshot}).
        # @return [void]
        def metrics(index, pid, metrics)
          add(index, pid, Counters.counts(metrics))
        end

        # Worker `pid` exited: what it counted stays, its last report is dropped.
        # @return [void]
        def forget(pid)
          @seen.delete(pid)
        end

        # @return [Array<Integer>] the worker indexes anything was counted for.
        def indexes
          @totals.keys.sort
        end

        # @return [Integer] requests started by every worker so far.
        def requests_started
          @totals.each_value.sum { |counts| counts.fetch(STARTED, 0) }
        end

        # What the workers at `index` counted, shaped as a {Metrics#snapshot}'s
        # counters: `{"requests" => {"GET 2xx" => n}, "requests_timed_out" => n, ...,
        # "request_duration" => {"counts" => [...], "sum" => s, "count" => n}, ...,
        # "database_pools" => {"primary" => {"timeouts" => n, "cancels" => n}}}`;
        # with `index` nil, every index's added up.
        # @param index [Integer, nil]
        # @return [Hash]
        def totals(index = nil)
          return shape(@totals.fetch(index, {})) if index

          sum = Hash.new(0)
          @totals.each_value { |counts| counts.each { |path, count| sum[path] += count } }
          shape(sum)
        end

        # @return [Hash] JSON-able, for {#initialize} in the next image.
        def carried
          @totals.to_h { |index, counts| [index.to_s, counts.to_a] }
        end

        private

        def add(index, pid, counts)
          seen = @seen[pid] ||= {}
          totals = @totals.fetch(index, {}).dup
          counts.each do |path, count|
            before = seen.fetch(path, 0)
            totals[path] = totals.fetch(path, 0) + (count >= before ? count - before : count)
            seen[path] = count
          end
          @totals = @totals.merge(index => totals.freeze).freeze
        end

        def shape(counts)
          shaped = { "requests" => {}, "database_pools" => {} }
          counts.each do |path, count|
            case path
            in ["requests", key] then shaped["requests"][key] = count
            in [String => key] if SCALARS.include?(key) then shaped[key] = count
            in [String => key, "counts", Integer => bucket] if HISTOGRAMS.include?(key)
              (shaped[key] ||= empty_histogram)["counts"][bucket] = count
            in [String => key, "sum" | "count" => part] if HISTOGRAMS.include?(key)
              (shaped[key] ||= empty_histogram)[part] = count
            in ["database_pools", name, key] then (shaped["database_pools"][name] ||= {})[key] = count
            else nil # STARTED: #requests_started
            end
          end
          shaped
        end

        def empty_histogram
          { "counts" => Array.new(Metrics::BUCKETS.size + 1, 0), "sum" => 0, "count" => 0 }
        end

        def restore(carried)
          @totals = carried.filter_map do |index, counts|
            next unless index.to_s.match?(/\A\d+\z/) && counts.is_a?(Array)

            valid = counts.select { |path, count| path.is_a?(Array) && count.is_a?(Numeric) }
            [Integer(index), valid.to_h.freeze]
          end.to_h.freeze
        end
      end
    end
  end
end
