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
        scheduler = Fiber.scheduler
        scheduler.forked! if scheduler.is_a?(Scheduler)
      end
      pid
    end
  end
  Process.singleton_class.prepend(ForkHook) unless Process.singleton_class < ForkHook
end
