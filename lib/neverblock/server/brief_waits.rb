# frozen_string_literal: true

module NeverBlock
  class Server
    # Keep-alive connections that went idle while {IdleSet::WAITING_FIBERS}
    # others already waited for their next request in their fibers: each
    # waits in its own fiber too, but only briefly, and parks in the
    # {IdleSet} if no request came by then. Its {IdleSet} makes one; the
    # server runs {#run} in a task of its own; {Connection} calls {#add}
    # and {#delete} around such a wait.
    #
    # Briefly is two turns of the loop, counted by this object's own task,
    # which passes its turn ({Scheduler#yield}) once per turn while any
    # connection waits so: a wait begun at tick `t` has been through at
    # least one whole selector call (epoll_wait, which resumes the fibers
    # whose sockets turned readable) by tick `t + 2`. A client that keeps
    # its connection busy (wrk -c400) sends its next request while the loop
    # answers the others: parking it at once cost each of those requests a
    # park, a wake-up of the {IdleSet} and a new task, about a third more
    # CPU per request (docs/benchmarks.md, "Held connections results").
    # Bounded memory is kept: connections going idle together (a burst)
    # hold fibers for two turns at most, not for a sweep interval as the
    # first {IdleSet::WAITING_FIBERS} do.
    #
    # Not thread-safe: the server uses it from its loop only.
    class BriefWaits
      # Ticks a wait lasts before its connection parks.
      TURNS = 2

      def initialize
        @waits = {}.compare_by_identity # Connection => the tick its wait began; oldest first
        @tick = 0
        @fiber = nil
        @asleep = false
      end

      # @return [Integer] connections waiting briefly now.
      def size
        @waits.size
      end

      # `connection` waits for its next request in its fiber, briefly.
      # @param connection [Connection]
      # @return [void]
      def add(connection)
        @waits[connection] = @tick
        return unless @asleep

        @asleep = false
        Fiber.scheduler.wake(@fiber)
      end

      # `connection`'s brief wait ended (a request came, it parked, it
      # closed). Does nothing for one not waiting.
      # @param connection [Connection]
      # @return [void]
      def delete(connection)
        @waits.delete(connection)
      end

      # Counts turns and parks the connections whose wait lasted {TURNS},
      # until its task is cancelled. Asleep while none waits.
      # @return [void]
      def run
        @fiber = Fiber.current
        scheduler = Fiber.scheduler
        while true # rubocop:disable Style/InfiniteLoop -- ends by cancellation
          if @waits.empty?
            @asleep = true
            scheduler.suspend while @asleep
          else
            scheduler.yield
            @tick += 1
            park_overdue
          end
        end
      end

      private

      # Parks the connections that began to wait {TURNS} ticks ago or
      # earlier: the first ones in @waits (a Hash keeps insertion order, and
      # a wait is added once, at the tick it begins).
      def park_overdue
        due = @tick - TURNS
        overdue = nil
        @waits.each do |connection, tick|
          break if tick > due

          (overdue ||= []) << connection
        end
        overdue&.each do |connection|
          @waits.delete(connection)
          connection.park_idle
        end
      end
    end
  end
end
