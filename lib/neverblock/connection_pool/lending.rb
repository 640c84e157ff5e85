# frozen_string_literal: true

module NeverBlock
  class ConnectionPool
    # How a {ConnectionPool} lends a connection: to a fiber or thread (its
    # owner) that has one already (one level deeper), from the idle list,
    # by opening one while the pool has room, or after a wait in line
    # ({Waiters}); a connection reused after a while passes the `healthy`
    # check first. Mixed into ConnectionPool, on its state (see
    # ConnectionPool#reset); each method says whether it is called with the
    # pool's lock held.
    module Lending
      private

      # Called without the lock; with interrupts deferred when
      # {.masks_needed?}. Lends `owner` its Hold, one level deeper: an existing
      # one, an idle connection, a new one while the pool has room, or the
      # next one handed over (FIFO) within `timeout`. An idle or handed-over
      # connection that fails the `healthy` check is closed and the next one
      # tried.
      # @return [Hold]
      # @raise [PoolTimeout] (see #wait_for_turn)
      def lend(owner = Fiber.current)
        detect_fork
        # (`while`, not `loop`: returning from a block allocates.)
        while true # rubocop:disable Style/InfiniteLoop
          hold = @lock.synchronize { lend_locked(owner) }
          if hold.equal?(:open)
            hold = open_connection
            return @lock.synchronize { lend_to(owner, hold, false) }
          end
          return hold unless hold.broken.equal?(:unchecked)

          hold.broken = false
          return hold if checked_healthy?(hold)

          hold.broken = true
          take_back(hold)
        end
      end

      # Called with the lock held; #wait_for_turn lets go of it while it
      # waits. `owner`'s Hold one level deeper, an idle one, one handed over
      # after a wait, or :open when a connection may be opened (the caller
      # opens it without the lock, then lends it).
      # @return [Hold, :open]
      def lend_locked(owner)
        if (hold = @holds[owner])
          hold.depth += 1
          return hold
        end
        if (hold = @idle.pop)
          return lend_to(owner, hold, true)
        end
        if @opened < @size
          @opened += 1
          return :open
        end
        handed = wait_for_turn
        handed.equal?(:open) ? handed : lend_to(owner, handed, true)
      end

      # Called with the lock held: lends `hold` to `owner`. A `reused`
      # connection (idle, or handed over) is marked :unchecked when the health
      # check is due.
      # @return [Hold]
      def lend_to(owner, hold, reused)
        hold.owner = owner
        hold.depth = 1
        hold.broken = reused && @healthy && due_for_check?(hold) ? :unchecked : false
        @holds[owner] = hold
      end

      def due_for_check?(hold)
        @check_after.zero? || Clock.now - hold.returned_at >= @check_after
      end

      # Called without the lock: the body of #with. Lends a connection for
      # the block and takes it back after, broken if the block raised one of
      # `broken_on`.
      def lend_for_block
        hold = lend
        broken = false
        begin
          yield hold.connection
        rescue *@broken_on
          broken = true
          raise
        ensure
          hold.broken ||= broken
          take_back(hold)
        end
      end

      # Called without the lock: runs the health check on a Hold just lent;
      # if the check is interrupted (a timeout, a cancel), the connection is
      # taken back broken and the interrupt raised.
      def checked_healthy?(hold)
        healthy?(hold.connection)
      rescue Exception # rubocop:disable Lint/RescueException -- re-raised
        hold.broken = true
        take_back(hold)
        raise
      end

      def healthy?(connection)
        return @healthy.call(connection) unless ConnectionPool.masks_needed?

        Thread.handle_interrupt(ALLOW) { @healthy.call(connection) }
      rescue *INTERRUPTIONS
        raise
      rescue StandardError => e
        NeverBlock.logger.debug("NeverBlock") { "pooled connection failed its health check: #{e.class}: #{e.message}" }
        false
      end
    end
  end
end
