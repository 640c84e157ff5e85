# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # Fork: what becomes of a scheduler in a child process forked on its
    # thread. The loop, its tasks and its selector belong to the parent; the
    # child goes on in the forking fiber as plain blocking code, without a
    # scheduler, and exits when that fiber ends. No other task of the parent
    # ever runs in the child.
    #
    # Who calls it, and when (all in the child, on the forking thread):
    # - ForkHook (Process._fork) calls #forked! right after the fork;
    # - Fiber.set_scheduler(nil), from #forked!, calls Scheduler#close, which
    #   hands over to #forked_close;
    # - the forking fiber, if it gets back to the scheduler anyway
    #   (Scheduler#suspend, or its task's fiber ending), ends the child in
    #   #exit_forked_child.
    #
    # The core checks @forked (and the pid it was created in, for a fork
    # that bypassed ForkHook) where a forked child must not go on as the
    # parent would: Scheduler#suspend, Scheduler#new_task_fiber,
    # Scheduler#close and Scheduler#offload.
    module Fork
      # @api private
      # Called by ForkHook in a child process forked on this scheduler's
      # thread: detaches the loop from the thread (see above).
      # @return [void]
      def forked!
        @forked = true
        Fiber.set_scheduler(nil) if Fiber.scheduler.equal?(self)
      end

      private

      # Closing the copy in the child releases only the child's descriptors.
      def forked_close
        @closed = true
        @forked = true
        # The parent's fibers, the wake-up's watcher among them, stay parked
        # in this copy of the selector: nothing in the child may resume them.
        Scheduler.strand(@selector)
        @selector.close
        @wakeup.close_forked
      end

      # In a forked child the fiber that forked has finished: leaving it would
      # hand control back to the parent's loop. End the child instead, as a
      # fork block ends (at_exit handlers run): status 1, with the error
      # logged, if its task failed.
      def exit_forked_child(task = nil)
        if task&.status == :failed
          @failures.log(task)
          Kernel.exit(1)
        end
        Kernel.exit(0)
      end
    end
  end
end
