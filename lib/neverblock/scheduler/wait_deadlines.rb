# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # The deadlines of the loop's timed waits in the selector (io_wait with a
    # timeout: Net::HTTP's read_timeout, a Redis client's, Socket's
    # connect_timeout), one timer a fiber, kept from wait to wait.
    #
    # Such a wait nearly always ends before its timeout: the IO comes ready.
    # A timer made for each wait and cancelled at its end cost a timed wait
    # 30 % more CPU than an untimed one on Ruby 3.1 (15 % on 3.4 + YJIT),
    # and the cancelled timers stayed in the heap for their whole timeout,
    # long enough for the GC to promote them. Here a fiber's timer stays in
    # the heap across its waits: a wait sets its deadline ({Deadline#arm}),
    # its end clears it ({Deadline#disarm}), and the timer is only moved
    # when it would fire after the new deadline. When it fires it looks at
    # the wait under way then: it expires the wait if the wait's deadline
    # has passed, moves itself to that deadline if not, and drops out (its
    # fiber forgotten) if there is no wait. A stream relayed with a 60 s
    # read timeout, a read every 50 ms, moves its timer once a minute.
    #
    # A fiber's entry goes when its timer fires with no wait under way, and
    # when the fiber ends ({#finished}): a task's fiber (Scheduler#new_task_fiber,
    # raw `Fiber.schedule` fibers too) and a FiberPool's. Other fibers that
    # wait through the loop (an app's own `Fiber.new(blocking: false)`, an
    # Enumerator's) are kept, dead, until their last wait's timeout.
    #
    # Who calls it, and when: IOHooks#in_selector, for every wait given a
    # timeout ({#start}, {Deadline#disarm}); Scheduler#run_once, on a turn
    # no fiber waits in the selector ({#clear}); Scheduler#fiber_ended
    # ({#finished}). Loop's thread only.
    class WaitDeadlines
      # One fiber's timed waits.
      # @api private
      class Deadline
        def initialize(owner, timers, fiber, expire)
          @owner = owner
          @timers = timers
          @fiber = fiber
          @expire = expire
          @due = nil # the deadline of the wait under way; nil: none
          @timer = nil # the timer in the heap, due at or before @due
        end

        # A wait begins that may last until `due` (monotonic seconds).
        # @return [self]
        def arm(due)
          @due = due
          timer = @timer
          return self if timer && timer.deadline <= due # it fires in time, and looks again then

          @timers.cancel(timer) if timer
          @timer = @timers.at(due, self)
          self
        end

        # The wait ended (the IO came ready, the fiber was woken or raised
        # into): its timer, left in the heap, expires nothing.
        # @return [void]
        def disarm
          @due = nil
        end

        # Takes its timer out of the heap and ends the wait's deadline (for
        # WaitDeadlines#clear and #finished, which drop the entry).
        # @return [void]
        def cancel
          @timers.cancel(@timer) if @timer
          @timer = nil
          @due = nil
        end

        # The heap's timer came due (from Timers#fire: the Deadline is the
        # timer's callable, no closure made for it).
        # @api private
        def call(_argument)
          @timer = nil
          due = @due
          if due && due > Clock.now
            @timer = @timers.at(due, self)
            return
          end

          @owner.forget(@fiber, self)
          return unless due

          @due = nil
          @expire.call(@fiber)
        end
      end

      # @param timers [Timers] the loop's heap.
      # @param expire [#call] called with the fiber whose wait timed out (it
      #   resumes the fiber, its wait answering false).
      def initialize(timers, expire)
        @timers = timers
        @expire = expire
        @deadlines = {}.compare_by_identity # fiber => Deadline
      end

      # `fiber` begins a wait of at most `timeout` seconds.
      # @param timeout [Numeric, ActiveSupport::Duration]
      # @return [Deadline, nil] disarm it when the wait ends; nil for an
      #   infinite timeout.
      # @raise [ArgumentError, TypeError] as Timers#after does.
      def start(fiber, timeout)
        seconds = Timers.delay(timeout) or return nil

        (@deadlines[fiber] ||= Deadline.new(self, @timers, fiber, @expire)).arm(Clock.now + seconds)
      end

      # Cancels every fiber's timer. For a turn on which no fiber waits in
      # the selector, so that none is armed: the loop's timers then are its
      # sleeps and timeouts alone (with none, it parks, and Ruby can tell a
      # deadlock).
      # @return [void]
      def clear
        return if @deadlines.empty?

        @deadlines.each_value(&:cancel)
        @deadlines.clear
      end

      # `fiber` ended: its timer goes, and the fiber is not kept for it.
      # @return [void]
      def finished(fiber)
        @deadlines.delete(fiber)&.cancel unless @deadlines.empty?
      end

      # @api private
      # `deadline`'s timer fired with no wait left to watch, or expired one.
      def forget(fiber, deadline)
        @deadlines.delete(fiber) if @deadlines[fiber].equal?(deadline)
      end
    end
  end
end
