# frozen_string_literal: true

module NeverBlock
  class Debouncer
    # Puts a process-local layer in front of a shared store (a
    # {RedisStore}): identical requests of one process coalesce in memory
    # first, and only the first of them talks to the shared store. A herd of
    # N requests spread over P processes then costs P claims and P waits in
    # Redis instead of N, and the followers of a process are woken in memory,
    # not each by a Redis round trip.
    #
    # It speaks the store protocol ({MemoryStore}); the {Debouncer} wraps
    # every store whose `shared?` is true in it.
    class LocalFirst
      # The lease of a process that leads for the whole shared store; its
      # local followers learn the outcome when it completes.
      Lease = Struct.new(:shared, :local)
      # A process whose first request follows another process's leader; its
      # local followers learn the outcome when that request does.
      Ticket = Struct.new(:shared, :local)
      private_constant :Lease, :Ticket

      # @return [Object] the shared store.
      attr_reader :shared

      # @param shared [Object] a store (see {MemoryStore}'s protocol).
      def initialize(shared)
        @shared = shared
        @local = MemoryStore.new(max_entries: 1) # for calls in flight only: nothing is stored locally
      end

      # @param key [String]
      # @return [Array] see the store protocol.
      def claim(key)
        role, flight = @local.claim(key)
        return [:follower, flight] if role == :follower

        begin
          role, value, lease = @shared.claim(key)
        rescue Exception # rubocop:disable Lint/RescueException -- the local followers must not wait for nothing
          @local.complete(flight, Outcome::PASS, 0)
          raise
        end
        case role
        when :leader then [:leader, Lease.new(value, flight)]
        when :follower then [:follower, Ticket.new(value, flight)]
        else
          # A stored response: the requests that queued behind this claim
          # claim again and find it themselves (answered as hits).
          @local.complete(flight, :retry, 0)
          lease ? [role, value, lease] : [role, value]
        end
      end

      # @param ticket [Object] from {#claim}.
      # @param timeout [Numeric] seconds.
      # @return [Object, nil] see the store protocol.
      def await(ticket, timeout)
        return @local.await(ticket, timeout) unless ticket.is_a?(Ticket)

        outcome = Outcome::PASS
        outcome = @shared.await(ticket.shared, timeout)
      ensure
        # nil (timed out): the local followers time out on their own clocks.
        @local.complete(ticket.local, outcome, 0) if ticket.is_a?(Ticket)
      end

      # @param lease [Object] from {#claim}.
      # @return [void]
      def complete(lease, outcome, ttl, stale = 0)
        return @shared.complete(lease, outcome, ttl, stale) unless lease.is_a?(Lease)

        begin
          @shared.complete(lease.shared, outcome, ttl, stale)
        ensure
          @local.complete(lease.local, outcome, 0)
        end
      end

      # @return [Integer] the shared store's stored responses.
      def size
        @shared.size
      end

      # Closes the shared store (when it can be closed).
      # @return [void]
      def close
        @shared.close if @shared.respond_to?(:close)
      end
    end
  end
end
