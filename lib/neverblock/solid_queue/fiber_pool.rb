# frozen_string_literal: true

module NeverBlock
  module SolidQueue
    # The execution pool of a Solid Queue worker configured with `fibers: N`,
    # when NeverBlock is loaded ({Seam}): the same contract as Solid Queue's
    # own `SolidQueue::FiberPool` (at most `size` jobs at once, {#post},
    # `available_capacity`, `idle?`, {#shutdown}, {#wait_for_termination}),
    # with jobs run on a NeverBlock event loop instead of an `async` reactor.
    #
    # - The loop runs in a thread of its own ({NeverBlock.run}), started
    #   when the first job is posted: in Solid Queue's default fork mode the
    #   pool is built in the supervisor, and a thread started there would
    #   not survive the fork.
    # - Each job is a {Task} (`NeverBlock.current_task` in a job), labelled
    #   with the job's id and class ({Task#label}), so the stall detector
    #   names a job that holds the loop, and what a job spawns
    #   is its child: cancelled when the job ends, however it ends.
    # - {#shutdown} takes no more jobs; those posted already run.
    #   {#wait_for_termination} gives them the timeout Solid Queue passes
    #   (`SolidQueue.shutdown_timeout`) less {CANCEL_GRACE}; the jobs still
    #   running then are released for another worker and cancelled, down to
    #   the query they wait on, before Solid Queue's supervisor stops the
    #   process at the end of that timeout.
    # - It counts its jobs ({JobCounts}: running, ended by outcome, their
    #   durations), read through {SolidQueue.stats}, and, in a `bin/jobs`
    #   that a NeverBlock server supervises, written for its `/metrics`
    #   ({Report}).
    #
    # Who calls it: the worker's polling thread ({#post}, `available_capacity`,
    # `idle?`) and its shutdown ({#shutdown}, {#wait_for_termination}); the
    # loop thread runs the jobs. The pool's state is guarded by `@state`;
    # `@jobs` belongs to the loop thread.
    class FiberPool < ::SolidQueue::Pool
      # Seconds before the end of the shutdown timeout at which the jobs
      # still running are released and cancelled (at most a fifth of the
      # timeout): the time they have to unwind before Solid Queue's
      # supervisor ends the process.
      CANCEL_GRACE = 1.0

      @all = []
      @all_lock = Mutex.new

      class << self
        # @return [Array<FiberPool>] the pools made in this process (and in
        #   the process it was forked from: Solid Queue builds a worker's
        #   pool in its supervisor), for {SolidQueue.stats}.
        def all
          @all_lock.synchronize { @all.dup }
        end

        # @api private
        def register(pool)
          @all_lock.synchronize { @all << pool }
        end
      end

      # @return [JobCounts] what this pool counted of its jobs.
      attr_reader :counts

      # @param size [Integer] the most jobs that run at once (`fibers:`).
      # @param on_idle [#call, nil] called when a job ends and frees a slot.
      # @param on_unrecoverable_error [#call, nil] called when a job raises
      #   a `SolidQueue::Processes::UnrecoverableError`.
      def initialize(size, on_idle: nil, on_unrecoverable_error: nil)
        super
        @state = Mutex.new
        @shutdown = false
        @fatal_error = nil
        @pending = Thread::Queue.new
        @loop_thread = nil
        @scheduler = nil
        @jobs = {}.compare_by_identity # Task => SolidQueue::ClaimedExecution
        @cancelling = false
        @report = nil # Report, made as the loop starts (in the worker process)
        @counts = JobCounts.new
        self.class.register(self)
      end

      # Runs `execution` as a task on the loop, starting the loop first if
      # need be.
      # @param execution [SolidQueue::ClaimedExecution]
      # @return [void]
      # @raise [RuntimeError] at capacity, or after {#shutdown}.
      # @raise [Exception] what stopped the loop, if it stopped.
      def post(execution)
        raise_if_fatal_error!
        raise "Execution pool is shutting down" if shutdown? # a RuntimeError, as Solid Queue raises it

        super
      end

      # @return [Integer] how many more jobs may be posted now.
      # @raise [Exception] what stopped the loop, if it stopped.
      def available_capacity
        raise_if_fatal_error!
        super
      end

      # Takes no more jobs; those posted run on. The loop ends when they have.
      # @return [Boolean] true for the call that shut the pool down.
      def shutdown
        first = @state.synchronize { @shutdown ? false : (@shutdown = true) }
        @pending.close if first
        first
      end

      # @return [Boolean]
      def shutdown?
        @state.synchronize { @shutdown }
      end

      # Waits for the jobs to end, at most `timeout` seconds less
      # {CANCEL_GRACE}; then releases the claims of the jobs still running
      # (Solid Queue makes them ready for another worker) and cancels them,
      # and waits for them the rest of `timeout`. Call after {#shutdown}.
      #
      # @param timeout [Numeric, ActiveSupport::Duration, nil] seconds; nil
      #   waits for as long as the jobs run.
      # @return [Boolean] true when the loop has ended.
      def wait_for_termination(timeout)
        thread = @loop_thread or return true
        return !thread.join.nil? if timeout.nil?

        seconds = timeout.to_f
        grace = [CANCEL_GRACE, seconds / 5].min
        return true if thread.join(seconds - grace)

        cancel_running_jobs
        !thread.join(grace).nil?
      end

      private

      def name
        @name ||= "solid_queue-neverblock-pool-#{object_id}"
      end

      def schedule(execution)
        @loop_thread ||= start_loop
        @pending << execution
      end

      # Starts the loop's thread and waits until its loop runs.
      # @return [Thread]
      # @raise [Exception] what kept the loop from starting.
      def start_loop
        booted = Thread::Queue.new
        @report = Report.build(@counts, object_id)
        thread = create_thread do
          NeverBlock.run do
            @scheduler = Fiber.scheduler
            booted << :ready
            NeverBlock.spawn { @report.run { drained? } } if @report
            run_jobs
          end
        rescue Exception => e # rubocop:disable Lint/RescueException -- any end of the loop is fatal to the pool
          register_fatal_error(e)
          booted << e
          raise
        end
        started = booted.pop
        raise started if started.is_a?(Exception)

        thread
      end

      # The loop's first task: spawns a task per posted execution until
      # {#shutdown}; `NeverBlock.run` then waits for the jobs still running.
      def run_jobs
        while (execution = @pending.pop)
          NeverBlock.spawn { perform_execution(execution) }
        end
      end

      # Whether every posted job has ended and none will be posted:
      # {Report} then writes its last counts and ends. Loop thread only.
      def drained?
        @pending.closed? && @pending.empty? && @counts.running.zero?
      end

      # Runs in the job's task. What the job spawned and left running is
      # cancelled before its slot is given back.
      def perform_execution(execution)
        started_at = Clock.now
        outcome = :failed # unless it returns, or is released at shutdown
        @counts.started
        job = NeverBlock.current_task
        @jobs[job] = execution
        wrap_in_app_executor do
          job.label = label(execution)
          execution.perform
        end
        outcome = :succeeded
      rescue Cancelled => e
        if @cancelling && job.cancel_requested?
          outcome = :cancelled
          NeverBlock.logger.warn("NeverBlock") do
            "#{label(execution)} was still running at the end of the shutdown timeout: " \
              "#{claimed?(execution) ? "released for another worker and " : ""}cancelled"
          end
        else
          raise_or_report(e)
        end
      rescue Exception => e # rubocop:disable Lint/RescueException -- as Solid Queue's pools: the worker reports it
        raise_or_report(e)
      ensure
        @jobs.delete(job)
        job.reap(0, "ended: its job is over") if job&.reapable?(0)
        @counts.ended(outcome, Clock.now - started_at)
        # Solid Queue's supervisor may kill the process a moment after a
        # cancel: the server hears of it now, not at the report's next turn.
        @report&.write if outcome == :cancelled
        restore_capacity
      end

      # Whether `execution` is a job a worker claimed. Solid Queue's pool
      # contract asks only that what is posted responds to #perform (its
      # own tests post plain objects): those have no job to name or to
      # release. (Solid Queue's models load with a Rails app: without one
      # there is no claimed execution.)
      def claimed?(execution)
        defined?(::SolidQueue::ClaimedExecution) && execution.is_a?(::SolidQueue::ClaimedExecution)
      end

      # The job's task label: the stall detector's and the task dump's name
      # for it.
      def label(execution)
        return "Solid Queue execution (#{execution.class})" unless claimed?(execution)

        "Solid Queue job #{execution.job_id} (#{execution.job.class_name})"
      end

      def raise_or_report(error)
        handle_unrecoverable_error(error)
        handle_thread_error(error)
      end

      # From the worker's thread, at the end of the shutdown wait: has the
      # loop release and cancel the jobs still running.
      def cancel_running_jobs
        scheduler = @scheduler or return
        scheduler.post { scheduler.spawn(detached: true, internal: true) { release_and_cancel_jobs } }
      rescue ClosedError
        nil # the loop ended meanwhile
      end

      def release_and_cancel_jobs
        @cancelling = true
        @jobs.to_a.each { |job, execution| release_and_cancel(job, execution) if job.alive? }
      end

      # Releases the job's claim and cancels the job in one transaction,
      # which holds the claim's row lock: the cancelled job's own
      # bookkeeping (Solid Queue would record it as failed) waits on that
      # lock and then finds the claim gone, and no other worker can claim
      # the job before the cancel. A job whose claim is already gone is
      # finishing on its own and is left to finish.
      def release_and_cancel(job, execution)
        return job.cancel unless claimed?(execution)

        wrap_in_app_executor do
          ::SolidQueue::ClaimedExecution.transaction do
            claim = ::SolidQueue::ClaimedExecution.lock.find_by(id: execution.id)
            job.cancel if claim&.release
          end
        end
      rescue StandardError => e
        handle_thread_error(e)
        job.cancel # the process is about to end: stop the job all the same
      end

      def register_fatal_error(error)
        @state.synchronize { @fatal_error ||= error }
        on_idle&.call # the worker polls again, and learns of it from #post
      end

      def raise_if_fatal_error!
        error = @state.synchronize { @fatal_error }
        raise error if error
      end
    end
  end
end
