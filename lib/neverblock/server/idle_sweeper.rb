# frozen_string_literal: true

module NeverBlock
  class Server
    # Ends the keep-alive connections that have waited `idle_timeout`
    # seconds for their next request: one task for the whole server,
    # instead of a timer made, pushed onto the loop's heap and cancelled by
    # every keep-alive wait (that is, by nearly every request).
    #
    # A connection waiting for its next request sets its
    # {Connection#idle_deadline}, tells the sweeper ({#watch}) and waits on
    # its socket with no timeout. The sweeper keeps each watched connection
    # in one slot of a timing wheel (a slot per `idle_timeout / 8` seconds,
    # at least 5 ms, at most 0.5 s), the slot of the next time it must look
    # at it; it wakes at each slot's end and looks only at the connections
    # in the slots that ended, so that what it costs follows the waits that
    # begin and end, not the connections held (10,000 idle connections cost
    # it two slots a second, not 20,000 looks). A connection whose deadline
    # has passed is closed: {Expired} is raised at its wait, or a parked one
    # is closed by {Connection#expire_idle} itself. A connection therefore
    # closes between `idle_timeout` and `idle_timeout` plus one interval
    # after its last request (5 to 5.5 s with the default 5 s). While no
    # connection is watched the sweeper sleeps ({SleepsUntilWork}), and
    # costs nothing.
    #
    # Where the server has an {IdleSet}, a connection whose fiber has waited
    # one interval is parked there ({Park}, {Connection#park_idle}): one or
    # two intervals after its last request it holds no fiber.
    #
    # A connection stays in its slot when it is served and waits again: its
    # new wait is due later, never sooner, and the sweeper moves it to the
    # slot of its new wait when it comes to it (or lets it go if it is not
    # waiting then). A busy keep-alive connection therefore costs the
    # sweeper one look per interval, whatever its request rate; {#forget}
    # takes out one that closed.
    #
    # Not thread-safe: the server uses it from its loop only.
    class IdleSweeper
      include SleepsUntilWork

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

      # @return [Float] seconds between sweeps: a slot of the wheel.
      attr_reader :interval

      # @param idle_timeout [Numeric] seconds.
      def initialize(idle_timeout)
        @idle_timeout = idle_timeout
        @interval = (idle_timeout / 8.0).clamp(MIN_INTERVAL, MAX_INTERVAL)
        @slots = {} # slot number => { Connection => true }
        @slot_of = {}.compare_by_identity # Connection => its slot number
        @swept = nil # the last slot swept (nil: none yet)
        @sleeper = nil # its task's fiber while nothing is watched (SleepsUntilWork)
      end

      # @return [Integer] connections in the wheel: waiting idle, or served
      #   since they last did and not looked at yet.
      def size
        @slot_of.size
      end

      # Sweeps while connections are watched, asleep otherwise, until its
      # task is cancelled.
      # @return [void]
      def run
        while true # rubocop:disable Style/InfiniteLoop -- ends by cancellation
          if @slot_of.empty?
            sleep_until_work
            skip_empty_slots
          else
            skip_empty_slots unless @swept # (watched before this task first ran)
            # Until the end of the first slot not swept yet (at once when it
            # has ended: the sweep before took long). A slot's look costs
            # one Hash lookup when it holds nothing, so the sweeper does not
            # look for the next slot that holds any.
            wait = (@swept + 1) * @interval - Clock.now
            NeverBlock.sleep(wait) if wait.positive?
            sweep
          end
        end
      end

      # `connection` waits for its next request ({Connection#idle_deadline}
      # set): it goes into the wheel, unless it is there already (from an
      # earlier wait, which was due sooner). A sleeping sweeper wakes.
      # @param connection [Connection]
      # @return [void]
      def watch(connection)
        return if @slot_of.key?(connection)

        place(connection, due(connection, connection.idle_deadline))
        work_arrived
      end

      # `connection` closed: out of the wheel (which would otherwise hold it
      # until its slot comes). Does nothing for one not in it.
      # @param connection [Connection]
      # @return [void]
      def forget(connection)
        slot = @slot_of.delete(connection) or return
        # (nil while its slot is being swept: #look then passes it over.)
        connections = @slots[slot] or return

        connections.delete(connection)
        @slots.delete(slot) if connections.empty?
      end

      private

      # @return [Float] when the sweeper must next look at a connection
      #   whose wait ends at `deadline` (monotonic seconds): once it has
      #   waited an interval in its fiber (to park it), then at its deadline.
      def due(connection, deadline)
        return deadline if connection.parked?

        parks_at = parks_at(deadline)
        parks_at < deadline ? parks_at : deadline
      end

      # @return [Float] when a wait that ends at `deadline` has lasted an
      #   interval.
      def parks_at(deadline)
        deadline - @idle_timeout + @interval
      end

      # Puts `connection` in the slot that ends at or after `time` (slot
      # `n` ends at `n * interval`), or the first slot not swept yet when
      # that one was swept already.
      def place(connection, time)
        slot = (time / @interval).ceil
        slot = @swept + 1 if @swept && slot <= @swept
        (@slots[slot] ||= {}.compare_by_identity)[connection] = true
        @slot_of[connection] = slot
      end

      # After a time with nothing to watch: the sweep goes on from the
      # first slot that holds any (those before it were empty all along),
      # not through every slot since the last sweep.
      def skip_empty_slots
        first = @slots.each_key.min or return # (few: those watched since it woke)

        @swept = first - 1 if @swept.nil? || first - 1 > @swept
      end

      # Looks at the connections of every slot that has ended: expires
      # those whose deadline passed, parks those that waited a whole
      # interval in a fiber, moves each still waiting to the slot of the
      # next look, and lets go of those not waiting (being served: their
      # next wait puts them back).
      def sweep
        now = Clock.now
        last = (now / @interval).floor
        while @swept < last
          @swept += 1
          @slots.delete(@swept)&.each_key { |connection| look(connection, now) }
        end
      end

      # Expiring or parking a connection runs its fiber before this
      # returns; that fiber (or another the loop runs meanwhile) may be
      # served and wait afresh: each step reads the connection again.
      # A connection it cannot end or park now (a resuming one, whose task
      # has not started) watches itself again at its next wait.
      def look(connection, now)
        return unless @slot_of.delete(connection) # forgotten meanwhile (it closed)

        deadline = connection.idle_deadline or return # served now: its next wait watches it again
        return connection.expire_idle(now) if deadline <= now

        waited = parks_at(deadline) <= now
        if waited
          connection.parked? ? connection.settle : connection.park_idle
        end
        deadline = connection.idle_deadline or return
        return if @slot_of.key?(connection) # served and waiting again already

        # Parked, or a wait that cannot park (no IdleSet): next at its deadline.
        place(connection, waited || connection.parked? ? deadline : parks_at(deadline))
      end
    end
  end
end
