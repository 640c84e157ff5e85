# frozen_string_literal: true

module NeverBlock
  # Process._fork is Ruby's documented extension point for code that must
  # react to fork (Ruby 3.1+). In the child, a NeverBlock loop running on the
  # forking thread is detached (Scheduler#forked!); nothing else changes.
  module ForkHook
    # @return [Integer] what Ruby's _fork returns (0 in the child).
    def _fork
      pid = super
      if pid.zero?
        NeverBlock.forked!
        scheduler = Fiber.scheduler
        scheduler.forked! if scheduler.is_a?(Scheduler)
      end
      pid
    end
  end

  class << self
    # @api private
    # Bumped in every forked child, so objects holding per-process resources
    # (ConnectionPool) can tell cheaply that they are in a new process.
    # @return [Integer]
    def fork_generation
      @fork_generation ||= 0
    end

    # @api private
    def forked!
      @fork_generation = fork_generation + 1
    end
  end
  Process.singleton_class.prepend(ForkHook) unless Process.singleton_class < ForkHook
end
