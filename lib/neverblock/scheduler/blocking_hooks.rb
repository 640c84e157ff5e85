# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # An #unblock from another thread, carried through the inbox to
    # Scheduler#drain_inbox (scheduler/threads.rb).
    Unblock = Struct.new(:fiber, :token)
    private_constant :Unblock

    # The blocking hooks of Fiber::Scheduler: how a fiber waits on a
    # Thread::Mutex, Queue, SizedQueue, ConditionVariable, Thread#join or
    # `sleep` (#block, #kernel_sleep), and how whoever releases it lets it
    # go on (#unblock); and #wait_until, NeverBlock's own wait for a
    # condition, built the same way.
    #
    # Who calls it, and when:
    # - Ruby, from a non-blocking fiber on the loop's thread: #block when
    #   one of those primitives is about to wait, #kernel_sleep on `sleep`
    #   (ConditionVariable#wait and Mutex#sleep sleep there too);
    # - Ruby, from any thread, #unblock once the Mutex, Queue or thread the
    #   fiber waits on lets it go; ConnectionPool calls #block and #unblock
    #   the same way for its own waits (and wakes a waiter of its own loop
    #   with Scheduler#wake_next, the core);
    # - NeverBlock's own code (FiberPool, Server, Group), from a
    #   non-blocking fiber on the loop's thread: #wait_until.
    #
    # Contracts:
    # - Every wait here is a Scheduler#suspend; an #unblock on the loop's
    #   thread is a Scheduler#wake, so it resumes only the wait it was for.
    # - An #unblock from another thread travels through the inbox as an
    #   Unblock naming the wait (its token); Scheduler#drain_inbox wakes the
    #   fiber only if it is in a #block or #kernel_sleep and, when a token
    #   was taken (nil: the unblock came before the fiber suspended), still
    #   in that same wait.
    # - A fiber woken without cause re-checks its Mutex or Queue and blocks
    #   again, which is how Ruby's own primitives are written.
    # - Loop's thread only, except #unblock; no locks.
    #
    # State it shares with the core (set up in Scheduler#initialize):
    # @timers, @waits, @wakeup, @wake_callback, @expire_callback,
    # @unblockable (the fibers in #block or #kernel_sleep) and
    # @sleeping_forever (how many are in a Kernel#sleep without a duration).
    module BlockingHooks
      # Fiber::Scheduler hook: `sleep`. Without a duration, sleeps until woken.
      # ConditionVariable#wait sleeps here, and its signal may come from
      # another thread (#unblock).
      #
      # Ruby tells the two waits without a duration apart by their arguments:
      # a bare `sleep` passes none, Mutex#sleep (ConditionVariable#wait,
      # Monitor's waits) passes nil. Outside a scheduler the first is no
      # deadlock to Ruby (a signal may end it) and the second is; so while a
      # fiber is in the first, the loop does not park where Ruby's deadlock
      # detector would see it. (`sleep(nil)`, forever since Ruby 3.3, arrives
      # as nil too and is taken for the second.)
      def kernel_sleep(duration = (no_argument = true; nil))
        raise ArgumentError, "time interval must not be negative" if duration&.negative?
        return wait_unblockable(duration, @wake_callback) unless no_argument

        @sleeping_forever += 1
        begin
          wait_unblockable(nil, @wake_callback)
        ensure
          @sleeping_forever -= 1
        end
      end

      # Fiber::Scheduler hook: a Mutex, Queue, ConditionVariable or
      # Thread#join is about to wait.
      # @return [Boolean] false if the timeout expired.
      def block(_blocker, timeout = nil)
        wait_unblockable(timeout, @expire_callback)
      end

      # Fiber::Scheduler hook: resume a fiber suspended in {#block}. Called from
      # any thread. A fiber woken without cause re-checks its Mutex or Queue and
      # blocks again, which is how Ruby's own primitives are written.
      def unblock(_blocker, fiber)
        if loop_thread?
          wake(fiber, true)
        else
          # The token names the wait this unblock is for. It is nil when the
          # fiber has not suspended yet (it queued itself on the Mutex or Queue
          # and this thread got in first); then the next wait is meant.
          @wakeup.push(Unblock.new(fiber, @waits[fiber]))
        end
      end

      # Suspends the current fiber until the block returns true, re-checking
      # it each time the fiber is woken ({#wake}), or until `timeout` seconds
      # have passed.
      #
      # @param timeout [Numeric, nil] seconds; nil waits without limit.
      # @return [Boolean] the block's last answer.
      def wait_until(timeout = nil)
        return true if yield

        fiber = Fiber.current
        expired = false
        timer = @timers.after(timeout) { expired = wake(fiber) } if timeout
        satisfied = false
        suspend until (satisfied = yield) || expired
        satisfied
      ensure
        @timers.cancel(timer)
      end

      private

      # Suspends the current fiber until #unblock (from any thread) or #wake,
      # or until `timeout` seconds pass and `on_timeout` is called with it.
      def wait_unblockable(timeout, on_timeout)
        fiber = Fiber.current
        timer = @timers.after(timeout, on_timeout, fiber) if timeout
        @unblockable[fiber] = true
        suspend
      ensure
        @unblockable.delete(fiber)
        @timers.cancel(timer)
      end
    end
  end
end
