# frozen_string_literal: true

require "logger"
require "timeout"

require_relative "neverblock/version"
require_relative "neverblock/errors"
require_relative "neverblock/llhttp_pin" # before the app compacts its heap (see the file)
require_relative "neverblock/clock"

# NeverBlock runs ordinary blocking-style Ruby concurrently: every task is a
# non-blocking fiber, and every blocking call in it (sockets, Net::HTTP, DNS,
# sleep, Timeout, Process.wait, Mutex, Queue, database drivers that wait on
# their socket) suspends only that fiber while the event loop serves the
# others. Outside {NeverBlock.run} the same code simply blocks.
#
#   NeverBlock.run do
#     tasks = urls.map { |url| NeverBlock.spawn { Net::HTTP.get(URI(url)) } }
#     NeverBlock.wait_all(tasks)
#   end
module NeverBlock
  # Default seconds a fiber may hold the loop before the stall detector warns.
  DEFAULT_STALL_THRESHOLD = 0.1

  # Default number of threads behind {NeverBlock.defer} and DNS lookups.
  DEFAULT_THREAD_POOL_SIZE = 16

  class << self
    # @return [Logger] where NeverBlock reports failed tasks and stalls;
    #   a Logger on $stderr unless set, at the level of NEVERBLOCK_LOG_LEVEL,
    #   else RAILS_LOG_LEVEL (what a Rails app's production.rb follows), else
    #   info (see {.log_level=}).
    def logger
      @logger ||= Logger.new($stderr, progname: "neverblock", level: env_log_level || Logger::INFO)
    end

    # Sets the level of {.logger} (`neverblock serve --log-level`,
    # `log_level` in a -C file or config/neverblock.rb).
    # @param name [String, Symbol] debug, info, warn, error, fatal or unknown.
    # @raise [ArgumentError] for another name.
    def log_level=(name)
      level = parse_log_level(name) or
        raise ArgumentError, "log level #{name.inspect}: one of debug, info, warn, error, fatal, unknown"
      logger.level = level if logger.respond_to?(:level=)
    end

    # @param logger [Logger, #warn, #error]
    attr_writer :logger

    # @return [Integer, nil] a Logger level, or nil for a name that is none.
    def parse_log_level(name)
      Logger::Severity.const_get(name.to_s.strip.upcase) if name.to_s.strip.match?(/\A(debug|info|warn|error|fatal|unknown)\z/i)
    end
    private :parse_log_level

    def env_log_level
      %w[NEVERBLOCK_LOG_LEVEL RAILS_LOG_LEVEL].each do |variable|
        value = ENV.fetch(variable, "")
        next if value.strip.empty?

        level = parse_log_level(value) and return level
        warn("NeverBlock: #{variable}=#{value} is not a log level (debug, info, warn, error, fatal, unknown); using info")
      end
      nil
    end
    private :env_log_level

    # @return [Float, nil] seconds a fiber may hold the loop before the stall
    #   detector logs a warning; nil when the detector is off. Defaults to
    #   `ENV["NEVERBLOCK_STALL_THRESHOLD"]` (seconds, or `off`), else 0.1.
    def stall_threshold
      return @stall_threshold if defined?(@stall_threshold)

      @stall_threshold = parse_stall_threshold(ENV.fetch("NEVERBLOCK_STALL_THRESHOLD", nil))
    end

    # @param seconds [Numeric, nil, false] nil or false turns the detector off.
    # @raise [ArgumentError] for a negative or NaN value.
    def stall_threshold=(seconds)
      @stall_threshold = seconds ? validate_timeout!(seconds, :stall_threshold).to_f : nil
    end

    # @return [Integer] threads behind {NeverBlock.defer}, per event loop.
    def thread_pool_size
      @thread_pool_size ||= DEFAULT_THREAD_POOL_SIZE
    end

    # @param size [Integer] >= 1.
    def thread_pool_size=(size)
      @thread_pool_size = validate_size!(size, :thread_pool_size)
    end

    # Runs an event loop on the current thread: the block runs in a
    # non-blocking fiber, and `run` returns once it and every task spawned
    # inside it have finished. Inside a running NeverBlock loop it just runs
    # the block. On a thread where another fiber scheduler is running (e.g.
    # Async), the loop runs on a new thread and only the caller waits.
    #
    # @param options [Hash] passed to {Scheduler#initialize}
    #   (`selector:`, `stall_threshold:`, `thread_pool_size:`).
    # @return [Object] the block's value.
    # @raise [Exception] whatever the block raised.
    def run(**options, &block)
      raise ArgumentError, "NeverBlock.run needs a block" unless block

      current = Fiber.scheduler
      if current.is_a?(Scheduler) && !current.closed?
        return yield unless Fiber.current.blocking?

        return current.run(&block)
      end
      return Thread.new { run(**options, &block) }.value if current

      scheduler = Scheduler.new(**options)
      Fiber.set_scheduler(scheduler)
      begin
        scheduler.run(&block)
      ensure
        Fiber.set_scheduler(nil)
      end
    end

    # Starts a task on the running loop: it runs at once until its first
    # wait, then `spawn` returns and the caller continues on the loop's next
    # turn.
    #
    # Spawned inside a task (or a request), the new task is its child: it is
    # cancelled when its parent fails, is cancelled or times out, and when
    # the request that started it ends ({Task::Tree}). `detached: true`
    # starts a task that outlives what started it (work after the response
    # is sent, a background refresh): nothing cancels it but {Task#cancel},
    # the loop's end and, for one spawned from a request, the server's
    # stop, after its drain ({Server::AppTasks}). It records where it was
    # spawned ({Task#spawned_at}).
    #
    # @param detached [Boolean]
    # @param internal [Boolean] @api private: see {Scheduler#spawn}.
    # @return [Task]
    # @raise [NoReactorError] outside {NeverBlock.run}.
    def spawn(detached: false, internal: false, &block)
      raise ArgumentError, "NeverBlock.spawn needs a block" unless block

      current_scheduler!.spawn(detached: detached, internal: internal, &block)
    end

    # @return [Task, nil] the task running in the current fiber (a request's
    #   task inside the server); nil outside one.
    def current_task
      Task.current
    end

    # @return [Numeric] seconds a task that ends by an exception, is
    #   cancelled or times out waits for its cancelled children to end
    #   before it detaches those still running (and logs them). Default 5.
    def cancel_timeout
      @cancel_timeout ||= 5
    end

    # @param seconds [Numeric] finite, >= 0.
    def cancel_timeout=(seconds)
      @cancel_timeout = validate_timeout!(seconds, :cancel_timeout)
    end

    # @return [Boolean] true inside a NeverBlock non-blocking fiber (where
    #   blocking calls suspend only the fiber), false anywhere else.
    def neverblocking?
      Fiber.scheduler.is_a?(Scheduler) && !Fiber.current.blocking?
    end

    # Sleeps for `seconds`: inside NeverBlock only the calling fiber waits.
    #
    # @param seconds [Numeric] >= 0.
    # @return [Integer] whole seconds slept by the wall clock, like Kernel#sleep.
    # @raise [ArgumentError] for a negative, NaN or non-numeric value.
    def sleep(seconds)
      Kernel.sleep(validate_timeout!(seconds, :seconds))
    end

    # Runs the block with `seconds` to finish. Inside NeverBlock, when time is
    # up while the block waits (IO, sleep, a lock, a task), the block is
    # unwound from that wait (its `ensure` clauses run) and {TimeoutError} is
    # raised where `timeout` was called; a block that computes without
    # waiting cannot be interrupted there. Outside NeverBlock, the same with
    # Timeout.timeout's thread. Zero expires immediately; nil means no limit.
    #
    # Inside the block the expiry is an internal RuntimeError that is not a
    # Timeout::Error ({TimeoutError::Expired}): code that rescues
    # Timeout::Error for its own timeouts does not mistake it for one
    # (Net::HTTP retried a timed-out GET after a Timeout::Error), while
    # `rescue => e` cleanup code still runs. A library that wraps it in an
    # error of its own (with it as the `cause`) still ends in a
    # {TimeoutError}. A {TimeoutError} raised inside the block by a nested
    # `timeout` is an ordinary error there.
    #
    # @param seconds [Numeric, nil]
    # @return [Object] the block's value.
    # @raise [TimeoutError] (a Timeout::Error) when time runs out.
    # @raise [ArgumentError] for a negative, NaN or non-numeric value.
    def timeout(seconds, &block)
      raise ArgumentError, "NeverBlock.timeout needs a block" unless block
      return yield(nil) if seconds.nil?

      validate_timeout!(seconds, :seconds)
      message = "execution expired after #{seconds} s"
      expired = TimeoutError::Expired.new(message)
      begin
        if neverblocking?
          Fiber.scheduler.timeout_after(seconds, expired, &block)
        else
          Timeout.timeout(seconds.zero? ? Float::MIN : seconds, expired, message, &block)
        end
      rescue Exception => e # rubocop:disable Lint/RescueException -- only this timeout's expiry is translated
        raise unless expired?(e, expired) # an enclosing timeout's, or any other error: as it is

        raise TimeoutError, message, expired.backtrace || e.backtrace, cause: e.equal?(expired) ? nil : e
      end
    end

    # Whether `error` is this timeout's expiry, or wraps it (a library that
    # rescued it and raised its own error, with the expiry as the cause).
    def expired?(error, expired)
      4.times do
        return true if error.equal?(expired)

        error = error.cause or return false
      end
      false
    end
    private :expired?

    # Runs the block on the loop's bounded thread pool and suspends only the
    # calling fiber until it is done: for CPU work and C extensions that
    # would block the loop. Outside NeverBlock it just calls the block.
    #
    # @return [Object] the block's value.
    # @raise [Exception] whatever the block raised.
    def defer(&block)
      raise ArgumentError, "NeverBlock.defer needs a block" unless block
      return yield unless neverblocking?

      Fiber.scheduler.defer(&block)
    end

    # Maps `enumerable` through the block with at most `concurrency` blocks
    # running at once; results come back in input order. The enumerable is
    # consumed lazily as slots free up. If a block raises, the others are
    # cancelled and the first exception is raised; with `fail_fast: false`
    # every item is mapped, and failures are raised together at the end as
    # a {GroupError} (each with its item and index, and the values of the
    # rest). Outside NeverBlock it runs its own loop. A {Group} with a limit.
    #
    # @param enumerable [Enumerable]
    # @param concurrency [Integer] >= 1.
    # @param fail_fast [Boolean] see {Group#initialize}.
    # @return [Array]
    # @raise [Exception] with fail_fast, the first failure.
    # @raise [GroupError] without fail_fast, when any block failed.
    def map(enumerable, concurrency: 10, fail_fast: true, &block)
      raise ArgumentError, "NeverBlock.map needs a block" unless block

      validate_size!(concurrency, :concurrency)
      return run { map(enumerable, concurrency: concurrency, fail_fast: fail_fast, &block) } unless neverblocking?

      group(limit: concurrency, fail_fast: fail_fast) do |tasks|
        enumerable.each { |item| tasks.spawn(item) { block.call(item) } or break }
      end
    end

    # Runs the tasks the block spawns in `group` and waits for them all:
    # their values in spawn order, or, at the first failure, the others
    # cancelled and that failure raised ({Group#wait}); with `fail_fast:
    # false` every task runs to its end and the failures are raised together
    # as a {GroupError}. If the block itself raises, the tasks are
    # cancelled. Outside NeverBlock it runs its own loop.
    #
    #   user, orders = NeverBlock.group do |group|
    #     group.spawn { fetch_user(id) }
    #     group.spawn { fetch_orders(id) }
    #   end
    #
    # @param limit [Integer, nil] at most this many tasks at once ({Group}).
    # @param fail_fast [Boolean] see {Group#initialize}.
    # @yieldparam group [Group]
    # @return [Array] the values, in spawn order.
    # @raise [Exception] with fail_fast, the first failure.
    # @raise [GroupError] without fail_fast, when any task failed.
    def group(limit: nil, fail_fast: true)
      raise ArgumentError, "NeverBlock.group needs a block" unless block_given?
      return run { group(limit: limit, fail_fast: fail_fast) { |tasks| yield tasks } } unless neverblocking?

      tasks = Group.new(limit: limit, fail_fast: fail_fast)
      begin
        yield tasks
        tasks.wait
      ensure
        tasks.cancel
      end
    end

    # Runs the tasks the block spawns and returns the first value one of
    # them returns; the others are cancelled (races, hedged requests). A
    # failure counts only when every task failed: then the first is raised.
    # Outside NeverBlock it runs its own loop.
    #
    #   NeverBlock.race do |group|
    #     group.spawn { primary.get(key) }
    #     group.spawn { sleep 0.05; replica.get(key) } # hedged after 50 ms
    #   end
    #
    # @yieldparam group [Group]
    # @return [Object] the winner's value.
    # @raise [Exception] the first failure, when all failed.
    def race
      raise ArgumentError, "NeverBlock.race needs a block" unless block_given?
      return run { race { |tasks| yield tasks } } unless neverblocking?

      tasks = Group.new(fail_fast: false)
      begin
        yield tasks
        tasks.first
      ensure
        tasks.cancel
      end
    end

    # Waits for every task, then returns their values in order; if any
    # failed, raises the first failure (in the order given) once all have
    # finished.
    #
    # @param tasks [Enumerable<Task>] what {spawn}, {Group#spawn} or
    #   {FiberPool#spawn} returned.
    # @return [Array]
    # @raise [ArgumentError] when `tasks` is not an Enumerable or holds
    #   anything but tasks (nothing is waited for).
    def wait_all(tasks)
      raise ArgumentError, "NeverBlock.wait_all takes a list of tasks, got #{tasks.inspect}" unless tasks.is_a?(Enumerable)

      tasks = tasks.to_a
      if (index = tasks.index { |task| !task.is_a?(Task) })
        raise ArgumentError, "NeverBlock.wait_all takes tasks (what NeverBlock.spawn and Group#spawn return), got " \
                             "#{tasks[index].inspect} (#{tasks[index].class}) at index #{index}; to run blocks and " \
                             "wait for their values, use NeverBlock.group or NeverBlock.map"
      end

      tasks.each(&:observe!)
      tasks.each(&:wait)
      tasks.map(&:value)
    end

    # @api private
    # @return [Scheduler] this thread's NeverBlock scheduler.
    # @raise [NoReactorError] when there is none.
    def current_scheduler!
      scheduler = Fiber.scheduler
      raise NoReactorError unless scheduler.is_a?(Scheduler) && !scheduler.closed?

      scheduler
    end

    # @api private
    # @return [Numeric] seconds, when finite and >= 0.
    def validate_timeout!(value, name)
      unless value.is_a?(Numeric) && value.real? && !(value.respond_to?(:nan?) && value.nan?) && value >= 0 &&
             value.finite?
        raise ArgumentError, "#{name} must be a finite number of seconds >= 0, got #{value.inspect}"
      end

      value
    end

    # @api private
    # @return [Integer] the size, when an Integer >= minimum.
    def validate_size!(value, name, minimum: 1)
      unless value.is_a?(Integer) && value >= minimum
        raise ArgumentError, "#{name} must be an Integer >= #{minimum}, got #{value.inspect}"
      end

      value
    end

    private

    def parse_stall_threshold(text)
      return DEFAULT_STALL_THRESHOLD if text.nil? || text.strip.empty?
      return nil if %w[off false no 0].include?(text.strip.downcase)

      seconds = Float(text, exception: false)
      raise ArgumentError, "NEVERBLOCK_STALL_THRESHOLD must be seconds or 'off', got #{text.inspect}" unless seconds

      validate_timeout!(seconds, :NEVERBLOCK_STALL_THRESHOLD)
    end
  end
end

# The short name, as in 2009.
NB = NeverBlock unless defined?(NB)

require_relative "neverblock/telemetry"
require_relative "neverblock/scheduler"
require_relative "neverblock/group"
require_relative "neverblock/semaphore"
require_relative "neverblock/server_semaphore"
require_relative "neverblock/fiber_pool"
require_relative "neverblock/connection_pool"

# In a Rails app (Bundler.require runs after Rails is loaded): fiber
# isolation, and the ActiveRecord adapters registered (see NeverBlock::Railtie).
# Elsewhere, once ActiveRecord loads, its adapters are registered too.
if defined?(::Rails::Railtie)
  require_relative "neverblock/railtie"
elsif defined?(::ActiveSupport.on_load)
  ActiveSupport.on_load(:active_record) { require "neverblock/active_record" }
end
