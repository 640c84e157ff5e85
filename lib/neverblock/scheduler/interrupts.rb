# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # Interrupts: raising an exception in a fiber at its current wait
    # (Task#cancel, NeverBlock.timeout and Timeout.timeout, IO#timeout, an
    # IO closed under a waiting fiber).
    #
    # Who calls it, and when:
    # - Task#cancel calls #interrupt on the loop's thread (from another
    #   thread it posts itself to the loop first);
    # - Timeout.timeout and NeverBlock.timeout call #timeout_after from the
    #   fiber that is to be interrupted;
    # - Ruby 3.4+ calls #fiber_interrupt, from any thread, when an IO a fiber
    #   waits on is closed;
    # - the IO hooks (IOHooks: IO#timeout, the close watch) and the timers
    #   above call #interrupt_fiber on the loop's thread.
    #
    # Contracts:
    # - An exception is raised only at a wait: code that computes without
    #   waiting is not interrupted.
    # - A delivery that cannot happen now (the fiber is resuming another
    #   fiber, such as an Enumerator) is retried a millisecond later, and
    #   only if the `still` block, when given, says the fiber is still in
    #   the wait the exception was meant for.
    # - Loop's thread only, except #fiber_interrupt; no locks.
    module Interrupts
      # Raises `exception` inside the task's fiber at its current wait.
      # @api private
      def interrupt(task, exception)
        fiber = task.fiber
        interrupt_fiber(fiber, exception) { task.fiber.equal?(fiber) } if fiber
      end

      # Fiber::Scheduler hook (Ruby 3.4+): an IO a fiber waits on was closed;
      # raise `exception` (an IOError) in that fiber. Thread-safe.
      def fiber_interrupt(fiber, exception)
        if loop_thread?
          interrupt_fiber(fiber, exception)
        else
          post { interrupt_fiber(fiber, exception) }
        end
      end

      # Runs `block` with `duration` seconds to finish; when it is still
      # waiting after that, `exception_class` is raised at its current wait.
      # Code that computes without waiting is not interrupted.
      #
      # `exception_class` may also be an exception object: timeout >= 0.4
      # passes one it later recognises by identity (its #exception returns
      # itself), so it is raised as given.
      #
      # A timeout that fires also cancels the tasks spawned inside its block
      # that still run (Task::Tree), and waits for them before the
      # exception goes on.
      #
      # @return [Object] the block's value.
      def timeout_after(duration, exception_class = TimeoutError, *message)
        fiber = Fiber.current
        active = true
        fired = false
        task = Thread.current[Task::Tree::CURRENT]
        mark = task.spawned if task
        timer = @timers.after(duration) do
          fired = true
          interrupt_fiber(fiber, exception_class.exception(*message)) { active }
        end
        yield duration
      ensure
        active = false
        @timers.cancel(timer)
        task.reap(mark, "timed out") if fired && task&.reapable?(mark)
      end

      private

      # Raises `exception` in `fiber` at its current wait, from a task or from
      # the loop fiber (timers). `still`, when given, says before a retry
      # whether the fiber is still in the wait the exception is meant for.
      def interrupt_fiber(fiber, exception, &still)
        return unless fiber.alive?

        if Fiber.current.blocking?
          fiber.raise(exception)
          reschedule_if_displaced(fiber)
        else
          queued { @selector.raise(fiber, exception) }
        end
      rescue FiberError
        # The fiber is resuming another fiber (e.g. an Enumerator) and cannot
        # be interrupted right now; try again shortly.
        retry_interrupt(fiber, exception, still)
      end

      # Delivers the interrupt shortly, if `still` (when given) says it still applies.
      def retry_interrupt(fiber, exception, still)
        @timers.after(0.001) { interrupt_fiber(fiber, exception, &still) if still.nil? || still.call }
      end
    end
  end
end
