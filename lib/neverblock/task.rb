# frozen_string_literal: true

require_relative "task/spawn_site"
require_relative "task/tree"

module NeverBlock
  # A unit of concurrent work: a block running in a non-blocking fiber of a
  # {Scheduler}. Created by {NeverBlock.spawn}, {FiberPool#spawn} and
  # `Fiber.schedule`.
  #
  # A task moves through these statuses:
  # - `:pending`   — created, not started yet;
  # - `:running`   — its block is executing (or suspended at a wait);
  # - `:completed` — the block returned; {#value} returns what it returned;
  # - `:failed`    — the block raised; {#value} re-raises that exception;
  # - `:cancelled` — {#cancel} stopped it; {#value} raises {Cancelled}.
  #
  # Tasks form a tree ({Tree}): a task spawned inside another is its child,
  # cancelled when its parent fails, is cancelled or times out.
  class Task
    include Tree

    # Exceptions that stop the event loop instead of failing one task: a
    # Ctrl-C or `exit` inside a task must still end the program.
    FATAL = [Interrupt, SignalException, SystemExit, NoMemoryError].freeze

    @block_end_hooks = nil # see Task.at_block_end

    class << self
      # @api private
      # Adds a hook run in every task's fiber when its block ends (returned,
      # raised or cancelled), before the task's end is reported to whoever
      # waits for it: per-fiber state that must not outlive the task goes
      # there, such as the database connections ActiveRecord leased to the
      # fiber ({NeverBlock::ActiveRecord::TaskLeases}). A hook that raises a
      # StandardError is logged, and the task's outcome stays its block's,
      # except for a cancellation or a timeout arriving while a hook waits,
      # which the task ends with. A hook is added once, however often this
      # is called with it.
      # @param hook [#call] called with no argument.
      # @return [void]
      def at_block_end(hook)
        hooks = @block_end_hooks || []
        @block_end_hooks = [*hooks, hook].freeze unless hooks.include?(hook)
      end

      # @api private
      # @return [Array<#call>, nil] the hooks of {.at_block_end}; nil while
      #   there are none (a task then checks only that).
      attr_reader :block_end_hooks

      # @api private
      # Runs the {.at_block_end} hooks in the current fiber.
      # @return [void]
      def block_ended(hooks)
        hooks.each do |hook|
          hook.call
        rescue *INTERRUPTIONS
          raise
        rescue StandardError => e
          NeverBlock.logger.warn("NeverBlock") { "a task's end hook #{hook.inspect} failed: #{e.class}: #{e.message}" }
        end
      end
    end

    # @return [Scheduler] the scheduler the task runs on.
    attr_reader :scheduler

    # @return [Symbol] `:pending`, `:running`, `:completed`, `:failed` or `:cancelled`.
    attr_reader :status

    # @api private
    # @param scheduler [Scheduler]
    # @param block [Proc] the work to run.
    # @param observed [Boolean] true when the creator promises to collect the
    #   result, so a failure is not logged (e.g. {NeverBlock.map}).
    def initialize(scheduler, block, observed: false, raw: false)
      @scheduler = scheduler
      @block = block
      @status = :pending
      @observed = observed
      @raw = raw if raw
      # The spawner's OpenTelemetry context, for an app that loads it (Telemetry).
      @telemetry = ::OpenTelemetry::Context.current if defined?(::OpenTelemetry::Context)
      # Set when needed (nil until then): @result, @fiber, @waiters,
      # @cancel_requested, @location, @owner, @storage, @label, and the tree's
      # @parent, @seq, @children, @spawned, @reaper, @ending, and a root's
      # @scope, @spawned_at, @internal. Spawning is a hot path, and each
      # assignment here is paid by every task.
    end

    # @return [String, nil] what the task runs, shown by {#inspect} (in log
    #   lines and the stall detector's warnings), e.g. "Solid Queue job 42
    #   (ReportJob)"; nil unless whoever runs the work names it.
    attr_accessor :label

    # @return [Fiber, nil] the fiber running the task, nil when it is not
    #   running. Pooled tasks share reusable fibers, so this changes over time.
    attr_reader :fiber

    # @return [Boolean] true while the task is pending or running.
    def alive?
      @status == :pending || @status == :running
    end

    # @return [Boolean] true once the task completed, failed or was cancelled.
    def finished?
      !alive?
    end

    # @return [Boolean] true if the task was cancelled.
    def cancelled?
      @status == :cancelled
    end

    # Waits until the task has finished, without raising its exception.
    #
    # From a fiber of the same scheduler only that fiber is suspended; from
    # another thread, that thread blocks. A task cannot wait for itself.
    #
    # @return [Task] self.
    # @raise [Error] if called from the task's own fiber, or from the event
    #   loop fiber itself (which would deadlock).
    def wait
      return self unless alive?

      if @scheduler.loop_thread?
        wait_in_loop
      else
        @scheduler.wait_from_other_thread(self)
      end
      self
    end

    # @return [Exception, nil] what ended a failed or cancelled task.
    def error
      @result if @status == :failed || @status == :cancelled
    end

    # Waits for the task and returns its result.
    #
    # @return [Object] the value the block returned.
    # @raise [Exception] the exception that ended the task, or {Cancelled}.
    def value
      wait
      @observed = true
      raise @result if @status == :failed || @status == :cancelled

      @result
    end

    # Cancels the task: raises {Cancelled} inside it at its current wait (or
    # at once when the task cancels itself), so its `ensure` blocks run. A
    # pending task finishes as cancelled without running. Cancelling a
    # finished task does nothing, and nor does cancelling one that is
    # already ending (waiting for its own children to stop). Its children
    # are cancelled as it ends ({Tree}). Safe to call from any thread.
    #
    # @return [Task] self.
    def cancel
      cancel_with(Cancelled.new)
    end

    # @return [Task, nil] the task running in the current fiber; nil outside
    #   one (the loop, a thread's root fiber, a raw `Fiber.schedule` fiber
    #   counts as a task).
    def self.current
      Thread.current[Tree::CURRENT]
    end

    # @api private
    # @return [Boolean] true once the task was asked to stop (Task#cancel, or
    #   its parent's end).
    def cancel_requested?
      @cancel_requested == true
    end

    # @return [String]
    def inspect
      location = @location || @block&.source_location
      "#<#{self.class.name}:0x#{object_id.to_s(16)} #{@status}#{" #{@label}" if @label}" \
        "#{" (#{location.join(':')})" if location}>"
    end
    alias to_s inspect

    # @api private
    # @return [Boolean] true for a fiber started by `Fiber.schedule`.
    def raw?
      @raw == true
    end

    # @api private
    # The pool or queue holding a pending task, told when it is cancelled.
    attr_writer :owner

    # @api private
    # The spawner's Fiber storage, for a task that runs in a pooled fiber.
    attr_accessor :storage

    # @api private
    # Runs the block in the current fiber; every exception is captured on the
    # task except {FATAL} ones, which propagate and stop the loop.
    # @return [void]
    def execute(fiber)
      return unless @status == :pending

      @fiber = fiber
      @status = :running
      Thread.current[Tree::CURRENT] = self
      @scheduler.task_started
      value = begin
        @telemetry ? Telemetry.within(@telemetry, &@block) : @block.call
      ensure
        (hooks = Task.block_end_hooks) && Task.block_ended(hooks)
      end
      @children ? finish(:completed, value) : conclude(:completed, value)
    rescue Cancelled => e
      finish(@cancel_requested ? :cancelled : :failed, e)
    rescue *FATAL => e
      @observed = true # it propagates out of the loop; logging it too would be noise
      conclude(:failed, e)
      raise
    rescue Exception => e # rubocop:disable Lint/RescueException -- a task reports every failure
      finish(:failed, e)
    end

    # @api private
    # Ruby could not create the task's fiber.
    # @return [void]
    def fail_to_start(error)
      message = "could not start #{inspect}: #{error.message} (too many live fibers? " \
                "Use a NeverBlock::FiberPool to bound them, or raise vm.max_map_count)"
      failure = FiberError.new(message)
      failure.set_backtrace(error.backtrace)
      conclude(:failed, failure)
    end

    # @api private
    # The caller promises to collect the result (NeverBlock.wait_all), so a
    # failure is not logged as unhandled.
    # @return [self]
    def observe!
      @observed = true
      self
    end

    # @api private
    # True when someone will see the task's failure (a fiber already waits,
    # or the creator promised to collect the result), so it is not logged.
    # @return [Boolean]
    def observed?
      @observed || !@waiters.nil?
    end

    protected

    # Task#cancel, with the exception to raise.
    def cancel_with(exception)
      return self unless alive?
      unless @scheduler.loop_thread?
        @scheduler.post { cancel_with(exception) }
        return self
      end

      case @status
      when :pending
        @cancel_requested = true
        @owner&.dequeue(self)
        conclude(:cancelled, exception)
      when :running
        return self if @ending

        @cancel_requested = true
        raise exception if Fiber.current.equal?(@fiber)

        @scheduler.interrupt(self, exception)
      end
      self
    end

    private

    # The block is done: its children go first (Tree), then the task ends.
    def finish(status, result)
      leave_tree(status) if @children
    ensure
      conclude(status, result)
    end

    def wait_in_loop
      current = Fiber.current
      raise Error, "a task cannot wait for itself" if current.equal?(@fiber)
      raise Error, "cannot wait for a task from the event loop fiber; wait from inside a task" if current.blocking?

      waiters = (@waiters ||= [])
      waiters << current
      begin
        @scheduler.suspend while alive?
      ensure
        waiters.delete(current) if alive?
      end
    end

    def conclude(status, result)
      return unless alive?

      @result = result
      @status = status
      @fiber = nil
      @location = @block&.source_location if status == :failed # for the deferred log line
      @block = nil
      leave_parent if @parent
      @scheduler.task_finished(self, status == :failed && !observed?)
      @waiters&.each { |fiber| @scheduler.wake(fiber) }
      @waiters = nil
    end
  end
end
