# frozen_string_literal: true

module NeverBlock
  class Server
    # Ends the keep-alive connections that have waited `idle_timeout`
    # seconds for their next request: one task for the whole server,
    # instead of a timer made, pushed onto the loop's heap and cancelled by
    # every keep-alive wait (that is, by nearly every request).
    #
    # A connection waiting for its next request sets its
    # {Connection#idle_deadline} and waits on its socket with no timeout;
    # the sweeper, every `idle_timeout / 8` seconds (at least 5 ms, at most
    # 0.5 s) while any connection waits so, raises {Expired} at the waits
    # whose deadline has passed, and the connection closes. A connection
    # therefore closes between `idle_timeout` and `idle_timeout` plus one
    # interval after its last request (5 to 5.5 s with the default 5 s).
    # While no connection waits idle the sweeper is parked, and costs
    # nothing.
    #
    # Where the server has an {IdleSet}, a connection whose fiber has waited
    # one interval is parked there ({Park}, {Connection#park_idle}): one or
    # two intervals after its last request it holds no fiber. A parked
    # connection that expires is closed by {Connection#expire_idle} itself.
    #
    # Not thread-safe: the server uses it from its loop only.
    class IdleSweeper
      # Raised at a connection's idle wait when its deadline has passed.
      class Expired < StandardError
      end

      # Raised at a connection's idle wait once it lasted a sweep interval:
      # the connection parks in the server's {IdleSet} and its fiber is
      # freed (see {Connection#park_idle}).
      class Park < StandardError
      end

      # Seconds between sweeps, at least and at most.
      MIN_INTERVAL = 0.005
      MAX_INTERVAL = 0.5

      # @return [Float] seconds between sweeps.
      attr_reader :interval

      # @param connections [Hash{Connection => true}] the server's open
      #   connections (read, never changed).
      # @param idle_timeout [Numeric] seconds.
      def initialize(connections, idle_timeout)
        @connections = connections
        @idle_timeout = idle_timeout
        @interval = (idle_timeout / 8.0).clamp(MIN_INTERVAL, MAX_INTERVAL)
        @fiber = nil
        @parked = false
      end

      # Sweeps while connections wait idle, parked otherwise, until its task
      # is cancelled.
      # @return [void]
      def run
        @fiber = Fiber.current
        scheduler = Fiber.scheduler
        while true # rubocop:disable Style/InfiniteLoop -- ends by cancellation
          # Parks only after a sweep that ran nothing: expiring a connection
          # lets other fibers run, which may begin idle waits unseen.
          if sweep.zero?
            @parked = true
            scheduler.suspend while @parked
          else
            NeverBlock.sleep(@interval)
          end
        end
      end

      # A connection has begun an idle wait: a parked sweeper starts again.
      # @return [void]
      def watch
        return unless @parked

        @parked = false
        Fiber.scheduler.wake(@fiber)
      end

      private

      # Expires the connections whose idle wait is over, and parks those
      # that waited a whole interval in a fiber.
      # @return [Integer] connections still waiting idle, plus those expired
      #   (while they ran, others may have begun to wait).
      def sweep
        now = Clock.now
        waiting = 0
        # A deadline this early: the wait began an interval ago or more.
        park_before = now + @idle_timeout - @interval
        # A snapshot: an expired connection runs (and leaves @connections)
        # before #expire_idle returns, and others may meanwhile be accepted.
        due = nil
        parking = nil
        @connections.each_key do |connection|
          deadline = connection.idle_deadline or next
          if deadline <= now
            (due ||= []) << connection
          else
            waiting += 1
            (parking ||= []) << connection if deadline <= park_before && !connection.parked?
          end
        end
        parking&.each(&:park_idle)
        return waiting unless due

        # Each one is checked again: one that was served meanwhile and waits
        # afresh has a later deadline.
        due.each { |connection| connection.expire_idle(now) }
        waiting + due.size
      end
    end
  end
end
