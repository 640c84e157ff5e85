# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # Threads: the one thread a scheduler serves, and the other threads that
    # deal with it. Binding the scheduler to its thread (and moving a
    # scheduler not used yet to the thread that first uses it), handing the
    # loop work from another thread (#post, and #drain_inbox, which runs
    # what was posted), and blocking another thread until a task finishes.
    #
    # Who calls it, and when:
    # - Scheduler#initialize, on the creating thread: #bind_thread;
    #   Scheduler#run, #spawn, #fiber and #close, on the calling thread:
    #   #claim_thread, which binds again if that thread is another one;
    # - any thread: #loop_thread? (Task, FiberPool, the blocking hooks and
    #   Scheduler#wake_next choose their path by it) and #post
    #   (ThreadPool::Job when its work is done, Task#cancel and
    #   #fiber_interrupt from another thread);
    # - another thread than the loop's, from Task#wait or Task#value:
    #   #wait_from_other_thread;
    # - the loop's thread: Scheduler#run_once calls #drain_inbox on every
    #   turn that finds the inbox not empty; Scheduler#task_finished calls
    #   #signal_foreign_waiters when some thread waits.
    #
    # Contracts:
    # - The inbox and the wake-up belong to Wakeup (scheduler/wakeup.rb);
    #   what an item means is decided here: an Unblock (BlockingHooks) wakes
    #   the fiber it names if that fiber is still in the wait it was for,
    #   anything else is a callable, run on the loop and logged if it fails.
    # - Locking: @foreign_lock guards @foreign_waiters and @foreign_cond.
    #   The loop reads @foreign_waiters without it, after the task's status
    #   is final (Task#conclude), so a thread that counts itself too late
    #   finds the task finished and does not wait.
    #
    # State it shares with the core (set up in Scheduler#initialize):
    # @thread, @loop, @selector, @wakeup, @inbox, @unblockable, @waits;
    # its own: @foreign_lock, @foreign_cond, @foreign_waiters.
    module Threads
      # @return [Boolean] true when called on the scheduler's thread.
      def loop_thread?
        Thread.current.equal?(@thread)
      end

      # Runs `callable.call` on the loop thread at its next turn. Thread-safe:
      # this is how other threads hand work to the loop.
      #
      # @param callable [#call]
      # @return [void]
      def post(callable = nil, &block)
        callable ||= block
        raise ArgumentError, "post needs a callable or a block" unless callable.respond_to?(:call)
        raise ClosedError, "this NeverBlock scheduler is closed" if @closed

        if loop_thread?
          @inbox << callable
        else
          @wakeup.push(callable)
        end
      end

      # @api private
      # Blocks a thread other than the loop's until `task` has finished.
      def wait_from_other_thread(task)
        @foreign_lock.synchronize do
          @foreign_waiters += 1
          @foreign_cond.wait(@foreign_lock) while task.alive?
        ensure
          @foreign_waiters -= 1
        end
      end

      private

      # The thread a scheduler serves is the one it was set on with
      # Fiber.set_scheduler, which need not be the one that created it. A
      # scheduler not used yet moves to the thread that first uses it.
      def claim_thread
        return if Thread.current.equal?(@thread)
        unless @tasks.empty? && @loop_depth.zero? && @io_waiting.zero? && Fiber.scheduler.equal?(self)
          raise Error, "this NeverBlock scheduler runs on #{@thread.inspect}; create one scheduler per thread"
        end

        @selector.close
        bind_thread
      end

      # Ties the scheduler to the current thread: its loop fiber, a selector
      # for it, and the wake-up's watcher fiber (created now, while a fiber
      # stack can surely be had; it waits in the selector only while the loop
      # runs, see #run_loop).
      def bind_thread
        @thread = Thread.current
        @loop = Fiber.current
        @selector = @selector_class.new(@loop)
        @wakeup.bind(@selector, @loop)
      end

      def drain_inbox
        until @inbox.empty?
          item = @inbox.pop
          if item.is_a?(Unblock)
            fiber = item.fiber
            next unless @unblockable.key?(fiber)
            next if item.token && @waits[fiber] != item.token # that wait is over

            wake(fiber, true)
          else
            run_posted(item)
          end
        end
      end

      # A posted callable's failure is its own: logged, and the loop goes on.
      def run_posted(callable)
        callable.call
      rescue StandardError => e
        NeverBlock.logger.error("NeverBlock") do
          "#{e.class} in a callable posted to the loop: #{e.message}\n  #{(e.backtrace || []).join("\n  ")}"
        end
      end

      def signal_foreign_waiters
        @foreign_lock.synchronize { @foreign_cond.broadcast }
      end
    end
  end
end
