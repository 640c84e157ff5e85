# frozen_string_literal: true

module NeverBlock
  class Server
    # The server's request slots: how many requests it answers at once, and
    # who waits for one. A {Server} makes one (from its `fiber_pool:` and
    # `adaptive_limit:` options) and starts it in its loop
    # ({Server#serve_here}); each {Connection} acquires a slot once a
    # request's head is complete and releases it when the connection is idle
    # again (its requests answered) or ends.
    #
    # - At most `size` (`fiber_pool`) slots are taken at once; with an
    #   adaptive limit ({ConcurrencyLimit}), at most its current limit, which
    #   a sampler task moves with the event loop's lag while requests are in
    #   flight (parked while none are, so an idle server costs nothing).
    # - A request that finds no free slot waits for one, first come first
    #   served: a released slot goes to the longest waiter (and stays
    #   taken), unless the limit fell below the slots taken.
    # - A request that only waits from some point on (a debouncer follower, a
    #   long poll, a stream) gives its slot back early: the app calls
    #   `env["neverblock.mark_as_io_bound"]` ({Server::MARK_AS_IO_BOUND}),
    #   its {Connection} releases the slot and calls {#marked_io_bound}.
    # - Whenever a slot becomes free (not handed to a waiter), or the
    #   adaptive limit rises, `on_release.room_freed` is called: the server's
    #   acceptors, which stop accepting while the slots the limit allows are
    #   taken ({#full?}), look again. So a busy worker leaves new connections
    #   in the kernel's accept queue, where a less busy worker of the same
    #   listening socket takes them; the limit sees them waiting there
    #   (`on_release.pending_connections`) as it sees requests waiting for a
    #   slot, and rises for them while the loop keeps up.
    #
    # Not thread-safe: the server and its connections use it from their
    # loop only.
    class Admission
      # @return [Integer] the most slots ever taken at once (`fiber_pool`).
      attr_reader :size

      # @return [Integer] slots taken now (requests being answered, and
      #   those handed a slot and about to run).
      attr_reader :taken

      # @return [Metrics, nil] told how long each request waited for its slot.
      attr_accessor :metrics

      # @return [#room_freed, #pending_connections, nil] see #initialize
      #   (the server's {Acceptor} sets itself).
      attr_writer :on_release

      # @param size [Integer] the most requests answered at once (`fiber_pool`).
      # @param adaptive_limit [Boolean, Hash] true: a {ConcurrencyLimit} with
      #   its defaults; a Hash: its options (`min:`, `initial:`, `target_lag:`);
      #   false or nil: no adaptive limit (`size` slots whatever the load).
      # @param on_release [#room_freed, #pending_connections, nil] told when a
      #   slot is given back to the free ones or the limit rises, and asked
      #   how many connections wait to be accepted (the {Acceptor}: a plain call,
      #   not a Method object's, as it is on every request's path).
      # @raise [ArgumentError] for an invalid size or `adaptive_limit`.
      def initialize(size:, adaptive_limit: true, on_release: nil)
        @size = NeverBlock.validate_size!(size, :fiber_pool)
        @limiter = build_limiter(adaptive_limit)
        @on_release = on_release
        @taken = 0
        @io_bound = 0 # requests that gave their slot back early, ever
        @waiters = [] # fibers waiting for a slot, oldest first
        @granted = {}.compare_by_identity # waiters handed a slot, not yet resumed
        @scheduler = nil
        @sampler = nil # the task feeding @limiter the loop's lag, while started
        @sampler_fiber = nil
        @sampler_parked = false # it waits in #sample_loop_lag for a request
        @stopping = false
      end

      # Starts the adaptive limit's sampler task (when there is a limit), in
      # the running NeverBlock loop. {Server#serve_here} calls it once, before
      # it accepts.
      # @return [void]
      def start
        @scheduler = NeverBlock.current_scheduler!
        @sampler = NeverBlock.spawn(detached: true, internal: true) { sample_loop_lag } if @limiter
      end

      # Stops the sampler (the server is stopping). Slots go on being
      # acquired and released while in-flight requests finish.
      # @return [void]
      def stop
        @stopping = true
        @sampler&.cancel
      end

      # Takes a request slot, waiting (first come, first served) until one
      # is handed over if none is free. The caller gives it back with
      # {#release}; a cancel (or any exception) during the wait leaves it
      # without one.
      # @return [Float] seconds it waited (0.0 when a slot was free).
      def acquire
        if try_acquire
          @metrics&.admitted(0.0)
          return 0.0
        end

        fiber = Fiber.current
        @waiters << fiber
        started = Clock.now
        @scheduler.suspend until @granted.delete(fiber)
        fiber = nil
        waited = Clock.now - started
        @metrics&.admitted(waited)
        waited
      ensure
        if fiber # the wait was interrupted: pass on a slot handed over meanwhile
          @waiters.delete(fiber)
          release if @granted.delete(fiber)
        end
      end

      # Gives a slot taken with {#acquire} back: to the request that has
      # waited longest for one, else (or when the adaptive limit fell below
      # the slots taken) to the free ones, calling `on_release.room_freed`.
      # @return [void]
      def release
        if !@waiters.empty? && @taken <= limit
          grant(@waiters.shift)
        else
          @taken -= 1
          @on_release&.room_freed
        end
      end

      # Waits for a turn in the same first-come-first-served queue as
      # requests waiting for a slot, then passes the slot on: a server's
      # acceptor calls it when the slots are all taken, so a connection
      # waiting in the kernel's accept queue is let in after the requests
      # queued before it, instead of only when a slot is released with no
      # request waiting, which keep-alive connections (each queuing its next
      # request as it releases its slot) could put off indefinitely.
      # @return [void]
      def wait_turn
        acquire
        release
      end

      # Counts a request that gave its slot back early (the slot itself comes
      # back through {#release}).
      # @return [void]
      def marked_io_bound
        @io_bound += 1
      end

      # @return [Boolean] whether the caller runs on the loop that started it
      #   (the only place its state may change).
      def on_loop?
        @scheduler ? @scheduler.loop_thread? : false
      end

      # @return [Boolean] whether the slots that may be taken now ({#limit})
      #   are: the server then stops accepting.
      def full?
        @taken >= limit
      end

      # @return [Integer] slots that may be taken now: the adaptive limit,
      #   else `size`.
      def limit
        @limiter ? @limiter.limit : @size
      end

      # @return [Hash] `{fiber_pool: {size:, limit:, busy:, queued:, io_bound:},
      #   adaptive_limit:}`, as in {Server#stats}: `busy` the slots taken,
      #   `queued` the requests waiting for one, `io_bound` the requests that
      #   gave theirs back early (a counter since start), `adaptive_limit`
      #   {ConcurrencyLimit#stats} (nil when there is no adaptive limit).
      def stats
        { fiber_pool: { size: @size, limit: limit, busy: @taken, queued: @waiters.size, io_bound: @io_bound },
          adaptive_limit: @limiter&.stats }
      end

      private

      # Takes a free slot (under the limit) if no request waits for one.
      # @return [Boolean] whether it took one.
      def try_acquire
        return false if @taken >= limit || !@waiters.empty?

        @taken += 1
        wake_sampler if @sampler_parked
        true
      end

      # @return [ConcurrencyLimit, nil]
      def build_limiter(option)
        case option
        when true then ConcurrencyLimit.new(max: @size)
        when false, nil then nil
        when Hash then ConcurrencyLimit.new(max: @size, **option)
        else raise ArgumentError, "adaptive_limit must be true, false or a Hash of options, got #{option.inspect}"
        end
      end

      # Hands a slot to a waiting request (the slot stays counted in @taken).
      def grant(waiter)
        @granted[waiter] = true
        @scheduler.wake(waiter)
      end

      # The adaptive limit rose: waiting requests take the new slots, oldest first.
      def admit_waiters
        while @taken < limit && (waiter = @waiters.shift)
          @taken += 1
          grant(waiter)
        end
      end

      # The sampler task: while requests are in flight, sleeps
      # ConcurrencyLimit::SAMPLE_INTERVAL at a time and tells the limiter how
      # late it woke (the loop's lag); with none in flight it is parked, so an
      # idle server does not wake 200 times a second. Cancelled by #stop.
      def sample_loop_lag
        interval = ConcurrencyLimit::SAMPLE_INTERVAL
        until @stopping
          if @taken.zero? && @waiters.empty?
            @limiter.idle
            @sampler_fiber = Fiber.current # not @sampler.fiber: spawn may not have returned yet
            @sampler_parked = true
            begin
              @scheduler.suspend
            ensure
              @sampler_parked = false
            end
            next
          end
          started = Clock.now
          NeverBlock.sleep(interval)
          lag = Clock.now - started - interval
          waiting = @waiters.size + (@on_release ? @on_release.pending_connections : 0)
          next unless @limiter.sample(lag, busy: @taken, waiting: waiting)

          admit_waiters
          @on_release&.room_freed if @taken < limit
        end
      end

      def wake_sampler
        @sampler_parked = false
        @scheduler.wake(@sampler_fiber)
      end
    end
  end
end
