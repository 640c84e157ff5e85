# frozen_string_literal: true

module NeverBlock
  class Server
    # How many requests the server answers at once, adapted to the load: a
    # limit on its request slots between `min` and `fiber_pool` (the hard
    # maximum), moved by the event loop's lag.
    #
    # Why the loop's lag: one process has one CPU's worth of Ruby. A request
    # that waits on IO (a query, a sleep, an upstream) costs the loop
    # nothing while it waits, so admitting more such requests is free and
    # serves them at once. A request that computes (Rails routing,
    # rendering, ActiveRecord's Ruby) needs the loop itself: once the loop is
    # busy all the time, admitting more of them adds no throughput, only
    # interleaving. Every admitted request then keeps its objects alive
    # longer (more of them survive into the old generation, and the GC marks
    # more), and each one's latency is that of all the others: the last of
    # 200 interleaved requests finishes after 200 requests' worth of CPU,
    # the first of 200 queued ones after one. The loop's lag (how late a
    # timer fires: the time the loop takes to get round to a fiber that
    # became ready) tells the two apart without knowing the app: waiting
    # requests leave it near zero, a CPU-saturated loop pushes it up in
    # proportion to the requests interleaved.
    #
    # So, in windows of `WINDOW` lag samples (a sampler task sleeps
    # `SAMPLE_INTERVAL` seconds at a time while requests are in flight):
    #
    # - the window's median lag above `target_lag`: the loop is saturated;
    #   the limit drops to 7/8 of the most requests seen in flight in the
    #   window (multiplicative decrease, from what was really admitted so
    #   that a high limit nobody used comes down at once), not below `min`;
    # - below it while requests waited for a slot: the loop had time to
    #   spare that waiting requests could use; the limit grows by a quarter
    #   (at least 1), up to `max`. Growth is multiplicative because
    #   IO-bound requests should all be admitted within a few windows (a
    #   hundred one-second queries arriving at once wait ~0.1-0.2 s, not
    #   seconds);
    # - otherwise it stays.
    #
    # It settles where the loop's backlog of ready work is about
    # `target_lag`: enough that the loop never idles for want of admitted
    # requests (so throughput is that of an unlimited server), small enough
    # that admitted requests finish quickly and the rest wait, cheaply and
    # first come first served, for a slot. The median (not the mean, not
    # the maximum) makes one long computation, which delays one sample
    # however few requests are in flight, not count as saturation.
    #
    # Not thread-safe: the server calls it from its loop only.
    class ConcurrencyLimit
      # Seconds between the sampler's timer wakes (while requests are in flight).
      SAMPLE_INTERVAL = 0.005
      # Lag samples per decision.
      WINDOW = 8
      # The `target_lag` default, seconds.
      DEFAULT_TARGET_LAG = 0.005
      # The `min` default (at most `max`).
      DEFAULT_MIN = 4
      # Where the limit starts (at most `max`): ten IO-bound requests at once
      # are admitted at once, before any window has passed.
      DEFAULT_INITIAL = 32

      # @return [Integer] requests admitted at once now.
      attr_reader :limit

      # @return [Integer]
      attr_reader :min, :max

      # @return [Float] seconds.
      attr_reader :target_lag

      # @param max [Integer] the hard maximum (the server's `fiber_pool`).
      # @param min [Integer] the lowest the limit goes (default 4, at most `max`).
      # @param initial [Integer] the starting limit (default 32, within min..max).
      # @param target_lag [Numeric] seconds of loop lag above which the loop
      #   counts as saturated (default 0.005).
      # @raise [ArgumentError] for a size under 1 or a lag that is not positive.
      def initialize(max:, min: DEFAULT_MIN, initial: DEFAULT_INITIAL, target_lag: DEFAULT_TARGET_LAG)
        @max = NeverBlock.validate_size!(max, :fiber_pool)
        @min = NeverBlock.validate_size!(min, :min).clamp(1, @max)
        @limit = NeverBlock.validate_size!(initial, :initial).clamp(@min, @max)
        @target_lag = NeverBlock.validate_timeout!(target_lag, :target_lag).to_f
        raise ArgumentError, "target_lag must be positive, got #{target_lag.inspect}" unless @target_lag.positive?

        @lags = []
        @busiest = 0
        @waited = false
        @decreases = 0
        @increases = 0
        @last_lag = 0.0
      end

      # Records one lag sample and, every `WINDOW` samples, moves the limit.
      # @param lag [Float] seconds the sampler's timer fired late.
      # @param busy [Integer] request slots taken now.
      # @param waiting [Integer] requests waiting for a slot now.
      # @return [Boolean] whether the limit rose (the caller admits waiters).
      def sample(lag, busy:, waiting:)
        @lags << lag
        @busiest = busy if busy > @busiest
        @waited ||= waiting.positive?
        return false if @lags.size < WINDOW

        decide
      end

      # Forgets a partial window (the server went idle: its samples describe
      # a load that is gone).
      # @return [void]
      def idle
        @lags.clear
        @busiest = 0
        @waited = false
      end

      # @return [Hash] `{limit:, min:, max:, target_lag:, lag:, increases:, decreases:}`
      #   (lag: the last window's median, seconds).
      def stats
        { limit: @limit, min: @min, max: @max, target_lag: @target_lag, lag: @last_lag.round(6),
          increases: @increases, decreases: @decreases }
      end

      private

      def decide
        lag = median(@lags)
        @last_lag = lag
        before = @limit
        if lag > @target_lag
          @limit = [(@busiest * 7 / 8), @limit].min.clamp(@min, @max)
          @decreases += 1 if @limit < before
        elsif @waited
          @limit = (@limit + [@limit / 4, 1].max).clamp(@min, @max)
          @increases += 1 if @limit > before
        end
        idle
        @limit > before
      end

      def median(values)
        sorted = values.sort
        sorted[sorted.size / 2]
      end
    end
  end
end
