# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # Fiber hooks: the Fiber::Scheduler methods about fibers themselves
    # rather than what they wait on (#fiber for `Fiber.schedule`, #yield,
    # and #transfer as in Ruby's reference scheduler), and how the loop
    # keeps fibers that user code moves by hand (Fiber#transfer,
    # Fiber#raise, Fiber.yield) from being lost or resumed twice.
    #
    # Who calls it, and when (all on the loop's thread):
    # - Ruby: #fiber on `Fiber.schedule`, from the loop's fiber (the
    #   thread's root fiber, in raw use) or from a task; #yield (Rubies
    #   newer than 3.4) from a non-blocking fiber;
    # - code written for the reference scheduler: #transfer, from the fiber
    #   that leaves the loop's care;
    # - the core, after it has run a fiber and got control back
    #   (Scheduler#run_ready, Scheduler#start) and Interrupts after a
    #   Fiber#raise: #reschedule_if_displaced; Scheduler#run_ready for a
    #   RESUME entry: #resume_displaced.
    #
    # Contracts:
    # - A fiber is displaced when the loop ran it and got control back
    #   while it is parked nowhere NeverBlock knows of (not in @waits, not
    #   released): the loop resumes it on its next turn, for nothing else
    #   ever would.
    # - A fiber released (#transfer, or a raw fiber that called Fiber.yield,
    #   see #start_resumed) belongs to whoever resumes it by hand: the loop
    #   neither resumes it nor waits for it to finish. @released holds it
    #   until it comes back or ends (Scheduler#new_task_fiber).
    # - Loop's thread only; no locks.
    #
    # State it shares with the core (set up in Scheduler#initialize):
    # @tasks, @waits, @ready, @released, @loop, @running, @selector.
    module FiberHooks
      # Fiber::Scheduler hook: `Fiber.schedule`. Unlike {#spawn}, the fiber
      # starts at once, as Ruby specifies.
      # @return [Fiber]
      def fiber(&block)
        raise ClosedError, "this NeverBlock scheduler is closed" if @closed

        claim_thread
        task = Task.new(self, block, raw: true)
        task.root_from(Task.current, false) # a root, as Ruby specifies; no spawn site: Ruby's hook, its own cost
        @tasks[task] = true
        fiber = new_task_fiber(task)
        if Fiber.current.equal?(@loop)
          start_resumed(task, fiber)
        else
          start(fiber)
        end
        fiber
      rescue FiberError => e
        task&.fail_to_start(e)
        raise
      end

      # Fiber::Scheduler hook (newer than 3.4; Ruby falls back to
      # `kernel_sleep(0)` without it): lets the other ready fibers run, then
      # resumes this one on the next turn of the loop.
      # @return [void]
      def yield
        queued { @selector.yield }
      end

      # Switches from the current fiber to the event loop without arranging
      # for it to be resumed, as Ruby's reference scheduler's #transfer does:
      # the fiber leaves the loop's care (the loop neither resumes it nor
      # waits for it to finish) until something resumes it with Fiber#transfer.
      # @return [Object] what the fiber is resumed with.
      def transfer
        fiber = Fiber.current
        task = @tasks.each_key.find { |candidate| candidate.fiber.equal?(fiber) }
        @tasks.delete(task) if task
        @released[fiber] = true
        @running = nil
        @loop.transfer
      ensure
        @released.delete(fiber)
      end

      private

      # Starts a raw fiber scheduled from the loop's own fiber (the thread's
      # root fiber, in raw use) so that, as with Ruby's reference scheduler,
      # a `Fiber.yield` in it returns to the code that called Fiber.schedule.
      # The root fiber cannot resume it itself (the fiber's waits transfer
      # back to the root, which Ruby forbids while the root is resuming it),
      # so a short-lived launcher fiber resumes it; when the fiber waits, the
      # launcher stays suspended in #resume until the fiber ends, then ends
      # too. A fiber that called Fiber.yield now belongs to whoever resumes it:
      # the loop stops counting it.
      def start_resumed(task, fiber)
        Fiber.new(blocking: true) do
          fiber.resume # returns when the fiber ends or calls Fiber.yield, now or later
          if fiber.alive? # it yielded: whoever resumes it owns it now
            @tasks.delete(task)
            @released[fiber] = true
          end
        end.transfer
        reschedule_if_displaced(fiber) # it may have moved on with Fiber#transfer or #raise
      end

      # The loop ran `fiber` and got control back, but `fiber` is not parked
      # anywhere NeverBlock knows of: user code moved away from it with a plain
      # Fiber#raise or #transfer. Nothing would ever resume it, so the loop
      # does, on its next turn.
      def reschedule_if_displaced(fiber)
        @ready.push(fiber, RESUME, nil) if fiber.alive? && !@waits.key?(fiber) && !@released.key?(fiber)
      end

      def resume_displaced(fiber)
        return unless fiber.alive? && !@waits.key?(fiber)

        fiber.transfer
        reschedule_if_displaced(fiber)
      rescue FiberError
        nil # it is resuming a fiber of its own (e.g. an Enumerator); that one returns to it
      end
    end
  end
end
