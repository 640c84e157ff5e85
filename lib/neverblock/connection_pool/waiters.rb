# frozen_string_literal: true

module NeverBlock
  class ConnectionPool
    # The waiter queue of a {ConnectionPool}: callers that found no
    # connection to lend wait here, first come, first served, until a
    # connection taken back (or the right to open one) is handed to them, or
    # until `timeout` seconds pass.
    #
    # Who calls it: ConnectionPool#lend_locked calls #wait_for_turn when the
    # pool is at `size` with nothing idle. #hand passes the oldest waiter a
    # connection taken back (ConnectionPool#hand_or_idle), or the right to
    # open one when a connection is closed or fails to open
    # (#take_back_locked, #open_connection, #leave). Nothing else touches
    # the queue, except the unlocked reads in #room? and #waiting.
    #
    # There are two ways to wait, chosen per waiter by
    # {ConnectionPool.masks_needed?}:
    #
    # - a fiber of a NeverBlock loop suspends in its scheduler
    #   (Scheduler#block) and is woken by Scheduler#unblock from any thread,
    #   or by Scheduler#wake_next from a fiber of its own loop, which lets it
    #   run in that fiber's place (#wait_in_loop). Nothing is allocated per
    #   wait: Waiter records are reused, and the waiters of one loop share
    #   one expiry timer (#arm_expiry, #expire_waiters);
    # - a plain thread, a blocking fiber, or a fiber under another scheduler
    #   waits on its Waiter's condition variable (#wait_on_condition).
    #
    # Mixed into ConnectionPool; works on the pool's own state, set up by
    # ConnectionPool#reset: @lock, @timeout, @opened, @waiters (Waiters,
    # oldest first), @spare (Waiters to reuse), @expiry (scheduler => its
    # armed timer) and @expire_callback.
    #
    # Lock discipline: every method here is called with @lock held and
    # returns with it held, also when it raises; #wait_in_loop and
    # #wait_on_condition let go of it while they wait. The exceptions are
    # said at the method: #expire_waiters (a timer callback: takes the lock
    # itself, never waits for it), and #relock and #lock_despite_interrupts
    # (called without it, they take it).
    module Waiters
      # One fiber or thread waiting for a connection: `handed` is set, with
      # the lock held, to the Hold handed over or to :open (the right to
      # open one). A fiber in a NeverBlock loop is woken through its
      # `scheduler`, and gives up at `deadline` (monotonic seconds) once its
      # loop's expiry timer has set `expired`; anything else waits on
      # `condition`. Records are reused (see #wait_for_turn); identity is
      # equality, so Array#delete finds the right one.
      class Waiter
        attr_accessor :fiber, :scheduler, :condition, :handed, :deadline, :expired
      end

      # Waiter records kept for reuse at most.
      SPARE_WAITERS = 128
      # Seconds before an expiry timer that found the lock taken tries again.
      EXPIRY_RETRY = 0.001
      private_constant :Waiter, :SPARE_WAITERS, :EXPIRY_RETRY

      private

      # Called with the lock held, and holds it on every way out: queues a
      # Waiter (a reused record) and waits for a Hold handed over or the
      # right to open a connection (:open). A waiter that is interrupted
      # passes on what it was handed meanwhile (#leave).
      # @return [Hold, :open]
      # @raise [PoolTimeout] when nothing came within `timeout` seconds.
      def wait_for_turn
        waiter = @spare.pop || Waiter.new
        @waiters << waiter
        begin
          ConnectionPool.masks_needed? ? wait_on_condition(waiter) : wait_in_loop(waiter)
        rescue Exception # rubocop:disable Lint/RescueException -- re-raised
          leave(waiter)
          raise
        end
        handed = waiter.handed
        unless handed
          @waiters.delete(waiter)
          recycle(waiter)
          @timeouts += 1
          raise PoolTimeout, "no connection free within #{@timeout} s (#{describe(stats_held)}); " \
                             "raise size or timeout, or hold connections for less time"
        end
        recycle(waiter)
        handed
      end

      # Called with the lock held, and holds it on every way out: hands
      # `what` (a Hold, or :open for the right to open a connection) to the
      # oldest waiter and wakes it. With `here` (a checkin), a waiter in the
      # calling fiber's own loop runs next (Scheduler#wake_next): in the
      # caller's place as soon as the caller waits, typically for its next
      # checkout. So the waiter's query goes out within the same turn of
      # the loop, and the selector does not drop and re-add the
      # connection's socket between the two fibers' waits on it, at one
      # fiber switch per checkin.
      # @return [Boolean] whether there was a waiter.
      def hand(what, here = false)
        waiter = @waiters.shift or return false
        @opened += 1 if what.equal?(:open)
        waiter.handed = what
        if (fiber = waiter.fiber)
          scheduler = waiter.scheduler
          if here && scheduler.equal?(Fiber.scheduler)
            scheduler.wake_next(fiber)
          else
            scheduler.unblock(waiter, fiber)
          end
        else
          waiter.condition.signal
        end
        true
      end

      # Called with the lock held; lets go of it while suspended and takes
      # it back before returning or raising (#relock). Suspends this fiber
      # in its NeverBlock scheduler (other threads may take connections back
      # meanwhile) until one is handed to it and it is woken
      # (Scheduler#unblock, from any thread; or Scheduler#wake_next) or its
      # deadline passes.
      #
      # No timer per wait: every waiter has the pool's one `timeout` and
      # joins the queue at the back, so deadlines grow along @waiters, and
      # the oldest waiter of a loop is the first of that loop to expire.
      # Each loop with waiters has one timer (#arm_expiry), due at its oldest
      # waiter's deadline; when it fires it expires the waiters that are due
      # and re-arms for the next one. Under steady contention it fires about
      # once per `timeout`, however many checkouts wait meanwhile.
      def wait_in_loop(waiter)
        scheduler = Fiber.scheduler
        waiter.fiber = Fiber.current
        waiter.scheduler = scheduler
        return if @timeout.zero? # no wait at all: PoolTimeout now, as on a thread

        waiter.deadline = Clock.now + @timeout
        arm_expiry(scheduler, waiter.deadline) unless @expiry.key?(scheduler)
        @lock.unlock
        begin
          # A wake-up without cause (#unblock is allowed to be spurious) waits again.
          scheduler.block(waiter, nil) until waiter.handed || waiter.expired
        ensure
          relock
        end
      end

      # Called with the lock held: arms `scheduler`'s expiry timer for
      # `deadline`. Forgets the timers of closed schedulers, whose loops will
      # never fire them.
      def arm_expiry(scheduler, deadline)
        @expiry.delete_if { |other, _| other.closed? } unless @expiry.empty?
        @expiry[scheduler] = scheduler.add_timer(deadline - Clock.now, @expire_callback, scheduler)
      end

      # Called without the lock, by `scheduler`'s expiry timer (on its
      # loop's own fiber): wakes its waiters whose deadline has passed,
      # without a connection, and re-arms for the next.
      #
      # The loop's own fiber must not wait for the lock: a fiber of this
      # loop may hold it while it waits for another lock (the Registry's,
      # held by another thread), and only the loop can resume that fiber.
      # When the lock is taken it tries again in EXPIRY_RETRY seconds (its
      # @expiry entry stays, so that no waiter arms a second timer
      # meanwhile).
      def expire_waiters(scheduler)
        return scheduler.add_timer(EXPIRY_RETRY, @expire_callback, scheduler) unless @lock.try_lock

        begin
          @expiry.delete(scheduler)
          now = Clock.now
          @waiters.each do |waiter|
            next unless waiter.scheduler.equal?(scheduler)

            if waiter.deadline > now
              arm_expiry(scheduler, waiter.deadline)
              break
            end
            waiter.expired = true
            scheduler.unblock(waiter, waiter.fiber)
          end
        ensure
          @lock.unlock
        end
      end

      # Called without the lock: takes it back after #wait_in_loop. Another
      # thread may hold it, so this may wait too, and a cancel or timeout
      # may arrive meanwhile: the lock is taken anyway and the interrupt
      # raised once it is held, so that the caller's cleanup runs with it.
      def relock
        interrupt = lock_despite_interrupts
        raise interrupt if interrupt
      end

      # Called without the lock; returns with it held, always. Takes the
      # lock even when an interrupt (a cancel, a timeout) arrives while it
      # waits for it (Mutex#lock then returns without the lock). Also used
      # by ConnectionPool#taking_back.
      # @return [Exception, nil] the interrupt, for the caller to raise once
      #   its work under the lock is done.
      def lock_despite_interrupts
        interrupt = nil
        begin
          @lock.lock
        rescue Exception => e # rubocop:disable Lint/RescueException -- returned for the caller to raise
          interrupt ||= e
          retry unless @lock.owned?
        end
        interrupt
      end

      # Called with the lock held, and holds it on every way out
      # (Mutex#sleep gives it up meanwhile): waits on the waiter's condition
      # variable until handed something or `timeout` seconds pass.
      def wait_on_condition(waiter)
        condition = (waiter.condition ||= Thread::ConditionVariable.new)
        deadline = Clock.now + @timeout
        until waiter.handed
          remaining = deadline - Clock.now
          break unless remaining.positive?

          wait(condition, remaining)
        end
      end

      # Called with the lock held, and holds it on every way out: waits on
      # `condition` for up to `seconds`.
      def wait(condition, seconds)
        Thread.handle_interrupt(ALLOW) { condition.wait(@lock, seconds) }
      rescue Exception # rubocop:disable Lint/RescueException -- re-raised
        # Ruby 3.1 does not take the lock back when a fiber's wait is raised
        # into (a cancel, a timeout); the callers' cleanup needs it.
        @lock.lock unless @lock.owned?
        raise
      end

      # Called with the lock held: an interrupted waiter leaves the queue;
      # what it was handed meanwhile goes on to the next waiter (or, a
      # connection, to the idle list).
      def leave(waiter)
        handed = waiter.handed
        if handed.nil?
          @waiters.delete(waiter)
        elsif handed.equal?(:open)
          @opened -= 1
          hand(:open)
        else
          hand_or_idle(handed)
        end
        recycle(waiter)
      end

      # Called with the lock held: keeps a Waiter no longer queued for the
      # next wait.
      def recycle(waiter)
        waiter.handed = waiter.fiber = waiter.scheduler = waiter.expired = nil
        @spare << waiter if @spare.size < SPARE_WAITERS
      end
    end
  end
end
