# frozen_string_literal: true

module NeverBlock
  class Server
    # Keep-alive connections that went idle while {IdleSet::WAITING_FIBERS}
    # others already waited for their next request in their fibers, and
    # whose last next request came soon (Connection#came_back_soon?: a busy
    # client): each waits in its own fiber too, but only briefly, and parks
    # in the {IdleSet} if no request came by then (the others park at
    # once). Its {IdleSet} makes one; the server runs {#run} in a task of
    # its own; {Connection} calls {#add} and {#delete} around such a wait.
    #
    # Briefly is {SECONDS}, and two turns of the loop besides: a client
    # that keeps its connection busy (wrk -c400) sends its next request
    # within a millisecond of its answer, but a saturated loop may see it
    # only a turn later (a turn answering hundreds of requests takes longer
    # than {SECONDS}), and parking a connection whose request is already
    # there cost that request a park, a wake-up of the {IdleSet} and a new
    # task. So once the oldest waits have lasted {SECONDS}, this object's
    # task passes its turn twice ({Scheduler#yield}), by which time the loop
    # has been through a whole selector call (epoll_wait, which resumes the
    # fibers whose sockets turned readable) since they began, and parks
    # those still waiting. Memory stays bounded: connections going idle
    # together (a burst) hold fibers for a few milliseconds, not for a sweep
    # interval as the first {IdleSet::WAITING_FIBERS} do.
    #
    # Not thread-safe: the server uses it from its loop only.
    class BriefWaits
      include SleepsUntilWork

      # Seconds a wait lasts at least before its connection parks.
      SECONDS = 0.005

      # @param seconds [Numeric] see {SECONDS}.
      def initialize(seconds: SECONDS)
        @seconds = seconds
        @waits = {}.compare_by_identity # Connection => when its wait began (monotonic seconds); oldest first
        @sleeper = nil # its task's fiber while nothing waits (SleepsUntilWork)
      end

      # @return [Integer] connections waiting briefly now.
      def size
        @waits.size
      end

      # `connection` waits for its next request in its fiber, briefly.
      # @param connection [Connection]
      # @return [void]
      def add(connection)
        @waits[connection] = Clock.now
        work_arrived
      end

      # `connection`'s brief wait ended (a request came, it parked, it
      # closed). Does nothing for one not waiting.
      # @param connection [Connection]
      # @return [void]
      def delete(connection)
        @waits.delete(connection)
      end

      # Parks the connections whose wait lasted {SECONDS} and two turns,
      # until its task is cancelled. Asleep while none waits
      # ({SleepsUntilWork}).
      # @return [void]
      def run
        scheduler = Fiber.scheduler
        while true # rubocop:disable Style/InfiniteLoop -- ends by cancellation
          if @waits.empty?
            sleep_until_work
            next
          end
          wait = oldest + @seconds - Clock.now
          NeverBlock.sleep(wait) if wait.positive?
          cutoff = Clock.now - @seconds
          due = overdue(cutoff) or next

          scheduler.yield
          scheduler.yield
          park(due, cutoff)
        end
      end

      private

      # @return [Float] when the oldest wait began.
      def oldest
        @waits.each_value { |began| return began }
      end

      # @return [Array<Connection>, nil] those whose wait began at `cutoff`
      #   or earlier: the first ones in @waits (a Hash keeps insertion order,
      #   and a wait is added once, when it begins).
      def overdue(cutoff)
        due = nil
        @waits.each do |connection, began|
          break if began > cutoff

          (due ||= []) << connection
        end
        due
      end

      # Parks those of `due` still in the wait they were in at `cutoff` (one
      # served meanwhile that waits afresh began after it).
      def park(due, cutoff)
        due.each do |connection|
          began = @waits[connection]
          next unless began && began <= cutoff

          @waits.delete(connection)
          connection.park_idle
        end
      end
    end
  end
end
