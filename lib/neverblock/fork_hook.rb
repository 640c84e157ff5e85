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
    # @return [Integer] how many forks this process descends from (through
    #   Process._fork): objects that remember it can tell they were created
    #   in a parent.
    def fork_generation
      @fork_generation ||= 0
    end

    # @api private
    # In a forked child: detach this thread's loop, then run the callbacks.
    # A failing callback is logged; it never stops the child's own code.
    # @return [void]
    def forked_child
      @fork_generation = fork_generation + 1
      scheduler = Fiber.scheduler
      scheduler.forked! if scheduler.is_a?(Scheduler)
      fork_callbacks.each do |callback|
        callback.call
      rescue StandardError => e
        logger.warn("NeverBlock") { "a fork callback failed in the child: #{e.class}: #{e.message}" }
      end
    end

    private

    def fork_callbacks
      @fork_callbacks ||= []
    end
  end
end
