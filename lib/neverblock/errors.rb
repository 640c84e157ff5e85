# frozen_string_literal: true

require "timeout"

module NeverBlock
  # The root of NeverBlock's errors: `rescue NeverBlock::Error` catches every
  # error this library raises, including {TimeoutError}.
  class Error < StandardError
    # {TimeoutError} has to be a `Timeout::Error` so that code written for the
    # standard library rescues it; Ruby has single inheritance, so {Error}
    # matches it explicitly. Only `Error` itself does this, not its subclasses.
    #
    # @param other [Object]
    # @return [Boolean]
    def self.===(other)
      super || (equal?(Error) && other.is_a?(TimeoutError))
    end
  end

  # Raised by APIs that need a running event loop when there is none on this
  # thread, e.g. {NeverBlock.spawn} called outside {NeverBlock.run}.
  class NoReactorError < Error
    def initialize(message = "no NeverBlock event loop is running on this thread; " \
                             "wrap the code in NeverBlock.run { ... }")
      super
    end
  end

  # Raised inside a task, at its current or next wait, when {Task#cancel} is
  # called; re-raised by {Task#value} to whoever waits on a cancelled task.
  class Cancelled < Error
    def initialize(message = "task was cancelled")
      super
    end
  end

  # Raised by {NeverBlock.timeout} when its block runs longer than allowed.
  # A `Timeout::Error`, so `rescue Timeout::Error` catches it too.
  class TimeoutError < Timeout::Error
  end

  # Raised by {FiberPool#spawn} when the pool's queue is at its `queue_limit`:
  # backpressure instead of unbounded memory growth.
  class PoolFull < Error
  end

  # Raised by {ConnectionPool#checkout} (and #with) when no connection is
  # free within the pool's timeout; the message has the pool's stats.
  class PoolTimeout < Error
  end

  # Raised by {FiberPool#spawn} after {FiberPool#shutdown}.
  class PoolClosed < Error
  end

  # Raised when a database connection cannot be opened: after bounded
  # retries with backoff for a server that is down or starting up, at once
  # for a refusal that retrying cannot fix (wrong password, unknown
  # database). The driver's error is the `cause`.
  class ConnectError < Error
  end

  # Raised when a scheduler is used after {Scheduler#close}.
  class ClosedError < Error
  end
end
