# frozen_string_literal: true

module NeverBlock
  class Debouncer
    # The default store: coalesces the fibers and threads of one process.
    #
    # One Mutex guards two Hashes: the calls in flight (key → {Flight}) and
    # the stored responses (key → response and expiry, in least-recently-used
    # order, at most `max_entries`). Followers wait on their flight's
    # ConditionVariable. Under NeverBlock's scheduler a Mutex and a
    # ConditionVariable suspend only the waiting fiber, and a leader on
    # another thread wakes it; outside NeverBlock they block the thread.
    #
    # == The store protocol
    #
    # A store is any object with these methods (a Redis-backed store
    # implements the same ones, with a lease that expires):
    #
    # claim(key) :: `[:hit, response]` (a stored {Outcome::Response}),
    #   `[:stale, response, lease]` (a stored response past its ttl but within
    #   its stale-while-revalidate window: answer with it, and refresh it in
    #   the background with the lease), `[:leader, lease]` (the caller must
    #   call upstream, then {#complete}), or `[:follower, ticket]` (someone
    #   else is calling; pass the ticket to {#await}).
    # await(ticket, timeout) :: the {Outcome} once the leader completes, nil
    #   after `timeout` seconds, or `:retry` when the leader vanished (its
    #   lease expired) and the caller should claim again.
    # complete(lease, outcome, ttl, stale) :: hands `outcome` to every
    #   follower; stores a {Outcome::Response} for `ttl` seconds when `ttl` > 0,
    #   then serves it stale for `stale` more seconds while one request
    #   refreshes it. Called exactly once per lease.
    # size :: the number of stored responses.
    class MemoryStore
      # A call in flight: its followers wait for `outcome`.
      # @api private
      Flight = Struct.new(:key, :condition, :outcome)

      # A stored response.
      # @api private
      Entry = Struct.new(:response, :expires_at, :stale_until)

      # @param max_entries [Integer] stored responses kept at most; the least
      #   recently used goes first.
      def initialize(max_entries: 10_000)
        @max_entries = NeverBlock.validate_size!(max_entries, :max_entries)
        @mutex = Thread::Mutex.new
        @flights = {}
        @entries = {}
      end

      # @param key [String]
      # @return [Array(Symbol, Object)] see the store protocol above.
      def claim(key)
        @mutex.synchronize do
          entry = @entries.delete(key)
          flight = @flights[key]
          if entry && entry.stale_until > (time = Clock.now)
            @entries[key] = entry # most recently used now
            return [:hit, entry.response] if entry.expires_at > time || flight

            return [:stale, entry.response, @flights[key] = Flight.new(key, Thread::ConditionVariable.new)]
          end
          return [:follower, flight] if flight

          [:leader, @flights[key] = Flight.new(key, Thread::ConditionVariable.new)]
        end
      end

      # Waits for the leader of `flight`. Only the caller's fiber (or thread)
      # waits.
      #
      # @param flight [Flight] the ticket from {#claim}.
      # @param timeout [Numeric] seconds.
      # @return [Outcome::Response, Outcome::Failure, Symbol, nil] nil on timeout.
      def await(flight, timeout)
        deadline = Clock.now + timeout
        @mutex.synchronize do
          until flight.outcome
            remaining = deadline - Clock.now
            return nil if remaining <= 0

            flight.condition.wait(@mutex, remaining)
          end
          flight.outcome
        end
      end

      # @param flight [Flight] the lease from {#claim}.
      # @param outcome [Outcome::Response, Outcome::Failure, Symbol]
      # @param ttl [Numeric] seconds to store a response; 0 stores nothing.
      # @param stale [Numeric] seconds after `ttl` to serve it stale.
      # @return [void]
      def complete(flight, outcome, ttl, stale = 0)
        @mutex.synchronize do
          flight.outcome = outcome
          @flights.delete(flight.key) if @flights[flight.key].equal?(flight)
          store(flight.key, outcome, ttl, stale) if ttl.positive? && outcome.is_a?(Outcome::Response)
          flight.condition.broadcast
        end
      end

      # @return [Integer] stored responses (at most `max_entries`).
      def size
        @mutex.synchronize { @entries.size }
      end

      # @return [Integer] upstream calls in flight.
      def in_flight
        @mutex.synchronize { @flights.size }
      end

      # Forgets every stored response (calls in flight go on).
      # @return [void]
      def clear
        @mutex.synchronize { @entries.clear }
      end

      private

      # Call with @mutex held.
      def store(key, response, ttl, stale)
        @entries.delete(key)
        expires_at = Clock.now + ttl
        @entries[key] = Entry.new(response, expires_at, expires_at + stale)
        @entries.shift while @entries.size > @max_entries
      end
    end
  end
end
