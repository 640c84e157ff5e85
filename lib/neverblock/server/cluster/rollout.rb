# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # When a generation has taken over, the log says so (included in
      # {Cluster}): a rolling restart (`USR2`) and a refork ({Refork}) replace
      # the workers one index at a time ({Cluster#continue_restart}), and an
      # operator waiting to deploy again, or to read memory, needs to know
      # when the last old worker is gone, not only when it was asked to stop.
      #
      # {#begin_rollout} is called as one begins (a later one replaces an
      # earlier: a `USR2` during a refork), {#abandon_rollout} when the new
      # workers cannot boot and the old ones go on, and {#notice_rollout_done}
      # at each turn of the master's loop, which logs the line once the
      # replacements are all started and every worker of an older generation
      # has exited.
      module Rollout
        private

        # @param kind [String] what the log calls it ("rolling restart").
        # @param detail [String, nil] added to the line ("forked from the mold ...").
        def begin_rollout(kind, detail = nil)
          @rollout = { kind: kind, detail: detail, started: Clock.now }
        end

        def abandon_rollout
          @rollout = nil
        end

        def notice_rollout_done
          return unless @rollout && @restart_queue.empty?
          return if @workers.each_value.any? { |worker| worker.generation != @generation }

          rollout = @rollout
          @rollout = nil
          NeverBlock.logger.info do
            "NeverBlock::Server: #{rollout[:kind]} done in #{(Clock.now - rollout[:started]).round(1)} s: generation " \
              "#{@generation}#{" #{rollout[:detail]}" if rollout[:detail]}, #{Server.workers_phrase(@count)} serving"
          end
        end
      end
    end
  end
end
