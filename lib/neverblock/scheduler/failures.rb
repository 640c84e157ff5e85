# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # Failure reporting: the tasks that failed with nobody waiting for their
    # result, logged once every fiber that could still collect it has had
    # its turn.
    #
    # Who calls it, and when (all on the loop's thread):
    # - Scheduler#task_finished records a task that failed unobserved
    #   ({#record});
    # - Scheduler#run_once asks, once per turn, just before the loop would
    #   wait, whether the recorded ones are due ({#due?}) and logs them
    #   ({#report}); Scheduler#close logs whatever is left;
    # - a forked child that exits logs its own failed task ({#log}).
    #
    # A task is not logged when it fails but when the loop is next about to
    # wait (every runnable fiber, the spawner included, has had its turn to
    # collect the result with Task#value or wait_all), or a second after it
    # failed if the loop never waits. A task observed by then stays silent.
    #
    # Not here: a raw `Fiber.schedule` fiber's failure outside
    # {NeverBlock.run}, which is not logged but raised from the loop (it is
    # the loop's exit, Scheduler#run_loop), and a callable posted to the
    # loop that fails (logged on the spot, Scheduler#run_posted).
    #
    # Not thread-safe: the loop's thread only.
    class Failures
      # Seconds after which recorded failures are logged even if the loop
      # has not waited since.
      PATIENCE = 1
      private_constant :PATIENCE

      def initialize
        @tasks = []
        @since = nil # Clock.now of the oldest recorded failure; nil when none
      end

      # Records a task that failed and that nobody had asked for the result
      # of yet; logged later by {#report} unless observed by then.
      # @param task [Task]
      # @return [void]
      def record(task)
        @since ||= Clock.now
        @tasks << task
      end

      # Called once per turn of the loop, so it costs one ivar read when
      # nothing is recorded.
      # @param interval [Numeric, nil] how long the loop is about to wait
      #   (seconds; nil without limit, 0 when it will not wait).
      # @return [Boolean] whether the recorded failures should be logged now.
      def due?(interval)
        @since ? (interval != 0 || Clock.now - @since > PATIENCE) : false
      end

      # Logs the recorded failures that nobody has observed since.
      # @return [void]
      def report
        tasks = @tasks
        @tasks = []
        @since = nil
        tasks.each { |task| log(task) unless task.observed? }
      end

      # Logs `task`'s error with its backtrace.
      # @param task [Task] a failed task.
      # @return [void]
      def log(task)
        error = task.error
        NeverBlock.logger.error("NeverBlock") do
          "unhandled #{error.class} in #{task.inspect}: #{error.message}\n  " \
            "#{(error.backtrace || []).join("\n  ")}"
        end
      end
    end
  end
end
