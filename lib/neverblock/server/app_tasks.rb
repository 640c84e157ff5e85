# frozen_string_literal: true

module NeverBlock
  class Server
    # What the app started from this server's requests and left running
    # beyond them: the roots of its scope ({Task::Tree#scope}). Those are
    # the tasks it spawned detached (`NeverBlock.spawn(detached: true)`: a
    # poller started lazily from a request, work after the response), its
    # `Fiber.schedule` fibers, and the children a request whose socket it
    # took left running. They outlive their request, not the server: the
    # stop cancels them once its requests are drained ({#cancel_left}), so
    # that a poller's `loop` does not keep the process up forever.
    #
    # Every connection's task is in the scope ({#enclose}), so every root
    # the app starts from a request is too ({Task::Tree#root_from}); the
    # tasks NeverBlock spawns for itself (`internal`, its accept loops, an
    # access-log flush, a debouncer's upstream call) never are, and nor is
    # other code's that shares the loop (a server run inside a running
    # NeverBlock loop).
    #
    # Who calls it: the {Acceptor} ({#enclose}, for each connection's task)
    # and {Server}'s shutdown ({#cancel_left}), on the loop's thread.
    class AppTasks
      # Seconds the cancelled tasks get at least to end, when the drain
      # used `shutdown_timeout` up (their `ensure` blocks run at their
      # next turn: this is for those that wait in them).
      LEAST_WAIT = 1.0

      # Puts a connection's task (a new root) in the scope.
      # @param task [Task]
      # @return [Task] the task.
      def enclose(task)
        task.scope = self
        task
      end

      # @param tasks [Array<Task>] the loop's ({Scheduler#tasks}).
      # @return [Array<Task>] those the app left running, in the scope.
      def left(tasks)
        tasks.select { |task| task.scope.equal?(self) && task.parent.nil? && !task.internal? && task.alive? }
      end

      # At a stop, once no request is left: cancels every task the app left
      # running ({#left}; each once: one cancelled already is left to its
      # `ensure`), logging each with where it was spawned, and waits for
      # them to end until `deadline`, or for {LEAST_WAIT} seconds if that is
      # later. What they start meanwhile is cancelled too. Those still
      # running then (they rescue {Cancelled}, or wait in a C call) are
      # logged, by name and backtrace; the loop still waits for them, and
      # the server's {Server#run} does not return before they end (a
      # worker's master kills it, `shutdown_timeout` plus
      # {Cluster::KILL_GRACE} seconds after its stop).
      # @param scheduler [Scheduler] the serving loop's.
      # @param deadline [Float] monotonic seconds.
      # @param label [String] what the log lines begin with
      #   (`NeverBlock::Server: worker 1 (pid 123)` in a worker).
      # @return [Boolean] true when every task ended in time.
      def cancel_left(scheduler, deadline, label = "NeverBlock::Server:")
        deadline = [deadline, Clock.now + LEAST_WAIT].max
        until (tasks = left(scheduler.tasks)).empty?
          tasks.each { |task| cancel(task, label) unless task.cancel_requested? }
          seconds = deadline - Clock.now
          next if seconds.positive? && wait_for(tasks, seconds)

          report_stragglers(left(scheduler.tasks), label)
          return false
        end
        true
      end

      # @return [String] what a task is, for the log and task dumps:
      #   `#<NeverBlock::Task ...>, spawned detached at FILE:LINE` (or
      #   `a Fiber.schedule fiber` / `left running when its parent returned`).
      def self.describe(task)
        if (site = task.spawned_at)
          "#{task.inspect}, spawned detached at #{site.path}:#{site.lineno}"
        elsif task.raw?
          "#{task.inspect}, a Fiber.schedule fiber"
        else
          "#{task.inspect}, left running when its parent returned"
        end
      end

      private

      def cancel(task, label)
        NeverBlock.logger.info { "#{label} stopping: cancelled #{AppTasks.describe(task)}" }
        task.cancel
      end

      # @return [Boolean] false when time ran out first.
      def wait_for(tasks, seconds)
        NeverBlock.timeout(seconds) { tasks.each(&:wait) }
        true
      rescue NeverBlock::TimeoutError
        false
      end

      def report_stragglers(tasks, label)
        return if tasks.empty?

        NeverBlock.logger.warn do
          lines = tasks.map do |task|
            frames = (task.fiber&.backtrace || []).first(TaskDump::FRAMES).map { |frame| "    #{frame}" }
            ["  #{AppTasks.describe(task)}:", *frames].join("\n")
          end
          "#{label} stopping: #{tasks.size} task#{'s' unless tasks.size == 1} the app left running did not end " \
            "when cancelled (they rescue NeverBlock::Cancelled, or wait in a C call); the stop waits for them:\n" \
            "#{lines.join("\n")}"
        end
      end
    end
  end
end
