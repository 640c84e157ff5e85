# frozen_string_literal: true

module NeverBlock
  class Task
    # Where the app spawned a detached task: the first frame of the spawning
    # fiber's stack outside NeverBlock's own files and Ruby's `<internal:>`
    # ones (the app's `NeverBlock.spawn(detached: true)` line, not
    # NeverBlock.spawn or FiberPool#spawn). A stopping server names it as it
    # cancels the task ({Server::AppTasks}); task dumps show it.
    #
    # Who calls it: {Tree#root_from}, as the app spawns a detached task;
    # tasks NeverBlock spawns for itself record none. It takes the stack
    # one frame at a time from the top (`caller_locations(depth, 1)` makes
    # a single Location), so it costs a walk of a few frames, not a whole
    # backtrace: a detached spawn, rarer than a request, pays it, and no
    # other spawn does.
    module SpawnSite
      # NeverBlock's files: lib/neverblock.rb and everything under lib/neverblock/.
      OWN = File.expand_path("../../neverblock", __dir__)

      # @return [Thread::Backtrace::Location, nil] the caller's first frame
      #   outside NeverBlock; nil when there is none (NeverBlock's own loop).
      def self.find
        depth = 1
        while (location = caller_locations(depth, 1)&.first)
          return location unless own?(location)

          depth += 1
        end
        nil
      end

      # @return [Boolean] whether the frame is NeverBlock's or Ruby's `<internal:>`.
      def self.own?(location)
        path = location.absolute_path || location.path
        path.nil? || path.start_with?(OWN) || path.start_with?("<internal:")
      end
      private_class_method :own?
    end
  end
end
