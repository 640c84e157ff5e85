# frozen_string_literal: true

module NeverBlock
  module SolidQueue
    # What one {FiberPool} counts of its jobs: those running now, those
    # ended by outcome, and how long they ran (a histogram). Read by
    # {SolidQueue.stats} and, in a server's supervised `bin/jobs`, written
    # for the master's `/metrics` by {Report}.
    #
    # The outcomes are the ends the pool sees: `succeeded` (`perform`
    # returned), `failed` (it raised: Solid Queue has recorded the job as
    # failed, or its error is reported), `cancelled` (still running at the
    # end of the shutdown timeout: released for another worker and
    # cancelled, {FiberPool#wait_for_termination}).
    #
    # Changed only by the pool's loop thread, at a job's start and end:
    # integer additions into storage made here, nothing allocated per job.
    # Read from any thread: a reader may see a job's end half counted (its
    # outcome, not yet its duration), never a torn number.
    class JobCounts
      # Upper bounds (seconds) of the duration histogram's buckets; the
      # last, +Inf, is implied. Wider than the server's request buckets: a
      # job that waits on an LLM or a mail server takes seconds to minutes.
      BUCKETS = [0.01, 0.05, 0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0].freeze

      # The counts of {#to_h} besides its `duration`.
      COUNTS = %i[running succeeded failed cancelled].freeze

      # @return [Integer] jobs started and not ended.
      attr_reader :running

      def initialize
        @running = 0
        @succeeded = 0
        @failed = 0
        @cancelled = 0
        @counts = Array.new(BUCKETS.size + 1, 0)
        @sum = 0.0
        @count = 0
      end

      # A job started. Loop thread only.
      # @return [void]
      def started
        @running += 1
      end

      # A job ended. Loop thread only.
      # @param outcome [Symbol] `:succeeded`, `:failed` or `:cancelled`.
      # @param seconds [Float] from its start to its end.
      # @return [void]
      def ended(outcome, seconds)
        case outcome
        when :succeeded then @succeeded += 1
        when :cancelled then @cancelled += 1
        else @failed += 1
        end
        index = 0
        index += 1 while index < BUCKETS.size && seconds > BUCKETS[index]
        @counts[index] += 1
        @sum += seconds
        @count += 1
        @running -= 1
      end

      # @return [Hash] `{running:, succeeded:, failed:, cancelled:,
      #   duration: {buckets:, counts:, sum:, count:}}`: `counts` per bucket
      #   (not cumulative), the last for durations above every bound.
      def to_h
        { running: @running, succeeded: @succeeded, failed: @failed, cancelled: @cancelled,
          duration: { buckets: BUCKETS, counts: @counts.dup, sum: @sum, count: @count } }
      end

      # @param hashes [Array<Hash>] {#to_h} of several pools.
      # @return [Hash] their sum, shaped as {#to_h}.
      def self.sum(hashes)
        hashes.each_with_object(new.to_h) do |counts, total|
          COUNTS.each { |key| total[key] += counts[key] }
          duration = total[:duration]
          counts[:duration][:counts].each_with_index { |count, index| duration[:counts][index] += count }
          duration[:sum] += counts[:duration][:sum]
          duration[:count] += counts[:duration][:count]
        end
      end

      # Whether `hash` has {#to_h}'s shape, with this version's buckets (a
      # pool of another version, during an upgrade, may have others), so
      # that {.sum} can add it.
      # @param hash [Object] e.g. a counts file's JSON, with symbol names.
      # @return [Boolean]
      def self.shaped?(hash)
        return false unless hash.is_a?(Hash) && COUNTS.all? { |key| hash[key].is_a?(Integer) }

        duration = hash[:duration]
        duration.is_a?(Hash) && duration[:sum].is_a?(Numeric) && duration[:count].is_a?(Integer) &&
          (counts = duration[:counts]).is_a?(Array) && counts.size == BUCKETS.size + 1 && counts.all?(Integer)
      end
    end
  end
end
