# frozen_string_literal: true

module NeverBlock
  class Server
    # For a server task that looks after connections ({BriefWaits},
    # {IdleSweeper}): with none to look after it sleeps, costing the loop
    # nothing, and the call that hands it the next one wakes it.
    #
    # Who calls it, and when: the including class's run loop calls
    # #sleep_until_work in its task when it has nothing to do; the method
    # that hands it work (BriefWaits#add, IdleSweeper#watch) calls
    # #work_arrived after, on every call (most find it awake: one check).
    # Both on the server's loop, which is all the locking it needs.
    module SleepsUntilWork
      # @return [Boolean] whether its task sleeps until work arrives.
      def asleep?
        !@sleeper.nil?
      end

      private

      # Suspends the current fiber (the task's) until #work_arrived.
      # @return [void]
      def sleep_until_work
        @sleeper = Fiber.current
        Fiber.scheduler.suspend while @sleeper
      ensure
        @sleeper = nil # also when the task is cancelled in its sleep
      end

      # Wakes the task if it sleeps; does nothing otherwise.
      # @return [void]
      def work_arrived
        sleeper = @sleeper or return

        @sleeper = nil
        Fiber.scheduler.wake(sleeper)
      end
    end
  end
end
