# frozen_string_literal: true

module NeverBlock
  # Process._fork is Ruby's documented extension point for code that must
  # react to fork (Ruby 3.1+). In the child, a NeverBlock loop running on the
  # forking thread is detached (Scheduler#forked!); nothing else changes.
  module ForkHook
    # @return [Integer] what Ruby's _fork returns (0 in the child).
    def _fork
      pid = super
      NeverBlock.forked_child if pid.zero?
      pid
    end
  end
  Process.singleton_class.prepend(ForkHook) unless Process.singleton_class < ForkHook

  class << self
    # @api private
    # Registers a block to run in every forked child, before the child's own
    # code (ConnectionPool forgets the parent's connections there).
    # @return [void]
    def on_fork_child(&block)
      fork_callbacks << block
    end

    # @api private
    # In a forked child: detach this thread's loop, then run the callbacks.
    # @return [void]
    def forked_child
      scheduler = Fiber.scheduler
      scheduler.forked! if scheduler.is_a?(Scheduler)
      fork_callbacks.each(&:call)
    end

    private

    def fork_callbacks
      @fork_callbacks ||= []
    end
  end
end
