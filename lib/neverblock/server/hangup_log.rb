# frozen_string_literal: true

module NeverBlock
  class Server
    # The log line for each request cancelled because its client hung up
    # (Exchange#hung_up): one info line per hang-up, without a backtrace. A
    # hang-up is ordinary (a closed tab, a balancer's timeout), but thousands
    # come at once when a proxy drops its upstream connections or a retry
    # storm gives up, and a line each would bury the log: after the first
    # line of a second, the hang-ups of that second are counted, and one
    # summary line says how many once the second is over.
    #
    # Who calls it: {Connection} (Exchange#hung_up) through its {Context};
    # the summary is written by a detached task it spawns. Loop's thread only.
    class HangupLog
      # Seconds in which only the first hang-up gets its own line.
      INTERVAL = 1.0

      def initialize
        @logged_at = nil # monotonic seconds of the last line of its own
        @suppressed = 0 # hang-ups since then without a line
        @summary = nil # the task that writes the summary line
      end

      # Logs a hang-up: its own line, or a count in the next summary line.
      # @param env [Hash] the request's Rack env.
      # @param during [String] what was cut, like "while the app handled it".
      # @return [void]
      def hung_up(env, during)
        now = Clock.now
        if @summary || (@logged_at && now - @logged_at < INTERVAL) # (a summary due is written a moment late)
          @suppressed += 1
          unless @summary
            wait = @logged_at + INTERVAL - now
            @summary = NeverBlock.spawn(detached: true, internal: true) { summarize(wait) }
          end
          return
        end

        @logged_at = now
        NeverBlock.logger.info("NeverBlock::Server: #{env['REQUEST_METHOD']} #{env['PATH_INFO']}: the client hung up " \
                               "#{during}; the request was cancelled (pid #{Process.pid})")
      end

      private

      # Writes the summary line `seconds` from now, for the hang-ups counted
      # until then; the next hang-up gets a line of its own again.
      def summarize(seconds)
        NeverBlock.sleep(seconds)
      ensure
        count = @suppressed
        @suppressed = 0
        @summary = nil
        @logged_at = Clock.now
        if count.positive?
          NeverBlock.logger.info("NeverBlock::Server: #{count} more requests were cancelled in the last second " \
                                 "because their client hung up (pid #{Process.pid})")
        end
      end
    end
  end
end
