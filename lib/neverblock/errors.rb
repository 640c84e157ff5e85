# frozen_string_literal: true

require "timeout"

module NeverBlock
  # Every error this library raises is a `NeverBlock::Error`: `rescue
  # NeverBlock::Error` catches them all, and `error.is_a?(NeverBlock::Error)`
  # is true for each, {TimeoutError} included.
  #
  # It is a module, not a class, because {TimeoutError} must also be a
  # `Timeout::Error` (so code written for the standard library rescues it)
  # and Ruby has single inheritance. The other errors descend from
  # {BaseError}, a StandardError that includes this module. Define your own
  # subclasses from {BaseError} (or from a more specific error).
  #
  # `raise NeverBlock::Error, "message"` still works: it raises a {BaseError}.
  module Error
    # Lets `raise NeverBlock::Error, "message"` raise a {BaseError}.
    # @param message [String, nil]
    # @return [BaseError]
    def self.exception(message = nil)
      BaseError.new(message)
    end

    # @param message [String, nil]
    # @return [BaseError]
    def self.new(message = nil)
      BaseError.new(message)
    end
  end

  # The class behind every NeverBlock error except {TimeoutError}; a
  # {NeverBlock::Error}.
  class BaseError < StandardError
    include Error
  end

  # Raised by APIs that need a running event loop when there is none on this
  # thread, e.g. {NeverBlock.spawn} called outside {NeverBlock.run}.
  class NoReactorError < BaseError
    def initialize(message = "no NeverBlock event loop is running on this thread; " \
                             "wrap the code in NeverBlock.run { ... }")
      super
    end
  end

  # Raised inside a task, at its current or next wait, when {Task#cancel} is
  # called; re-raised by {Task#value} to whoever waits on a cancelled task.
  class Cancelled < BaseError
    def initialize(message = "task was cancelled")
      super
    end
  end

  # Raised by {NeverBlock.timeout} when its block runs longer than allowed.
  # A `Timeout::Error`, so `rescue Timeout::Error` catches it too.
  class TimeoutError < Timeout::Error
    include Error

    # @api private
    # What {NeverBlock.timeout} raises inside its block when time is up; it
    # becomes a {TimeoutError} where the block is left.
    #
    # It is a RuntimeError but not a Timeout::Error. Code under the timeout
    # that rescues Timeout::Error for timeouts of its own does not take it
    # for one: Net::HTTP retries an idempotent request after a
    # Timeout::Error, and so ran a timed-out GET to its end. Code that
    # rescues StandardError to clean up still sees it (ActiveRecord marks
    # the interrupted connection for verification, a driver discards its
    # half-read reply), and code that translates errors passes a
    # RuntimeError through (ActiveRecord wraps others in StatementInvalid).
    class Expired < RuntimeError
      # Raising an instance again (Thread#raise, the scheduler's timer)
      # raises that same instance, so each timeout recognises its own.
      # @return [Expired] self.
      def exception(_message = nil)
        self
      end
    end
  end

  # @api private
  # What interrupts a fiber's wait from outside: a cancel, or a timeout
  # (NeverBlock's, or Ruby's Timeout). Cleanup code that logs and swallows
  # its own failures (closing a connection, a health check, a task's end
  # hooks) lets these through: `rescue *INTERRUPTIONS; raise`.
  INTERRUPTIONS = [Cancelled, Timeout::Error, TimeoutError::Expired].freeze

  # Raised by {FiberPool#spawn} when the pool's queue is at its `queue_limit`:
  # backpressure instead of unbounded memory growth.
  class PoolFull < BaseError
  end

  # Raised by {ConnectionPool#checkout} (and #with) when no connection is
  # free within the pool's timeout; the message has the pool's stats.
  class PoolTimeout < BaseError
  end

  # Raised by `acquire(timeout:)` of {ServerSemaphore} and RedisSemaphore
  # when no permit was free within the timeout.
  class SemaphoreTimeout < BaseError
  end

  # Raised by RedisSemaphore (`require "neverblock/redis_semaphore"`) when
  # Redis cannot be reached: it fails closed, the block does not run
  # (unless it was made with `unavailable: :run`). The Redis client's error
  # is the `cause`.
  class SemaphoreUnavailable < BaseError
  end

  # Raised by {FiberPool#spawn} after {FiberPool#shutdown}.
  class PoolClosed < BaseError
  end

  # Raised when a database connection cannot be opened: after bounded
  # retries with backoff for a server that is down or starting up, at once
  # for a refusal that retrying cannot fix (wrong password, unknown
  # database). The driver's error is the `cause`.
  class ConnectError < BaseError
  end

  # Raised by {Group#wait} ({NeverBlock.group}, {NeverBlock.map}) with
  # `fail_fast: false` once every task has finished, when any failed: it
  # carries every failure, each with its task and item, and the values of
  # the tasks that succeeded, so that one failure does not lose the rest's
  # work. Its `cause` is the first failure.
  class GroupError < BaseError
    # How many failures the message names; {#failures} has them all.
    NAMED = 3

    # @return [Array<Group::Failure>] every failure, in the order they
    #   happened.
    attr_reader :failures

    # @return [Array] every task's value in spawn order (for map, input
    #   order); nil for a task that failed.
    attr_reader :values

    # @param failures [Array<Group::Failure>] at least one.
    # @param values [Array]
    def initialize(failures, values)
      @failures = failures
      @values = values
      named = failures.first(NAMED).join("; ")
      more = failures.size > NAMED ? "; and #{failures.size - NAMED} more" : ""
      super("#{failures.size} of #{values.size} #{values.size == 1 ? 'task' : 'tasks'} failed: #{named}#{more} " \
            "(rescue NeverBlock::GroupError for #failures, each error with its task and item, and #values)")
    end
  end

  # Raised when a scheduler is used after {Scheduler#close}.
  class ClosedError < BaseError
  end
end
