# frozen_string_literal: true

module NeverBlock
  class ConnectionPool
    # How a {ConnectionPool} takes a connection back from its owner: one
    # level up, and at the outermost level to the oldest waiter, the idle
    # list, or (broken, or from before #disconnect_all) closed. An interrupt
    # arriving meanwhile cannot lose it. Mixed into ConnectionPool, on its
    # state (see ConnectionPool#reset); each method says whether it is
    # called with the pool's lock held.
    module TakingBack
      private

      # Called without the lock: {ConnectionPool#checkin} or {ConnectionPool#discard} (`broken`) of
      # `owner`'s Hold of `connection`, in one turn of the lock.
      # @raise [ArgumentError] if `owner` does not hold `connection`.
      def take_back_from(owner, connection, broken)
        held = true
        taking_back(connection) do
          hold = @holds[owner]
          next held = false unless hold&.connection.equal?(connection)

          hold.broken = true if broken
          take_back_locked(hold)
        end
        return if held

        who = owner.equal?(Fiber.current) ? "this fiber" : owner.inspect
        raise ArgumentError, "#{who} did not check out #{connection.inspect} from this pool"
      end

      # Called without the lock: takes `hold` back one level (see
      # #take_back_locked); closes the connection if it goes.
      def take_back(hold)
        return if hold.epoch != @epoch # held when the process forked: the parent's

        taking_back(hold.connection) { take_back_locked(hold) }
      end

      # Called without the lock: runs the block (a #take_back_locked) with the
      # lock held, then, with the lock let go, closes the connection if the
      # block's outcome says so (true).
      #
      # When another thread holds the lock a fiber waits for it, and an
      # interrupt arriving then (a timeout, a cancel) must not skip the
      # block, or the connection would never come back: the lock is taken
      # anyway, the connection goes back, and the interrupt is raised after.
      def taking_back(connection)
        interrupt = lock_despite_interrupts
        begin
          outcome = yield
        ensure
          @lock.unlock
        end
        close_quietly(connection) if outcome.equal?(true)
        raise interrupt if interrupt
      end

      # Called with the lock held: one level up; at the outermost level the
      # connection goes to the next waiter (which runs next if it is of the
      # caller's own loop, see #hand) or the idle list, or, if broken or from
      # before #disconnect_all, is to be closed (by the caller, after the
      # counts are right, so that a slow close delays no one).
      # @return [Boolean] true when the caller must close it.
      def take_back_locked(hold)
        hold.depth -= 1
        return false if hold.depth.positive?

        @holds.delete(hold.owner)
        hold.owner = nil
        if hold.broken || hold.generation != @generation
          @born.delete(hold.connection)
          Registry.delete(self) if @born.empty?
          @opened -= 1
          hand(:open)
          true
        else
          hand_or_idle(hold, true)
          false
        end
      end

      # Called with the lock held: a Hold no one owns goes to the oldest
      # waiter, else back to the idle list. `here` as for #hand.
      # @return [void]
      def hand_or_idle(hold, here = false)
        hold.returned_at = Clock.now if @healthy && @check_after.positive?
        @idle.push(hold) unless hand(hold, here)
      end
    end
  end
end
