# frozen_string_literal: true

module NeverBlock
  class Server
    # One log line for each request the server refuses itself (400, 408,
    # 413, 414, 431, 501, 505), naming the limit and how to raise it: a 413 for
    # an upload over `max_body` is otherwise a mystery to whoever sent it and
    # to whoever reads the logs. At most one line a second for each status
    # (a flood of bad requests, a fuzzer, must not flood the log); the next
    # line says how many were not logged meanwhile. {Connection} calls it
    # through its {Context}; used on the loop only.
    class RefusalLog
      # Where limits are set: `rails server -u neverblock` reads
      # config/neverblock.rb, `neverblock serve` its -C file.
      WHERE = "config/neverblock.rb (rails server), a -C file (neverblock serve) or Server.new"
      private_constant :WHERE

      # Where each limit is set, by the status it refuses with.
      HINTS = {
        408 => "limits header_timeout: / body_timeout: (seconds), min_body_rate: (bytes/s) in #{WHERE}",
        413 => "--max-body BYTES, or limits max_body: in #{WHERE}",
        414 => "limits max_request_target: (bytes) in #{WHERE}",
        431 => "limits max_header_bytes: / max_headers: in #{WHERE}"
      }.freeze

      # Seconds between two lines for one status.
      INTERVAL = 1.0

      def initialize
        @logged_at = {} # status => monotonic seconds
        @suppressed = Hash.new(0)
      end

      # @param error [HTTPError] the refusal (its message names the limit).
      # @param client [String] the client's address.
      # @return [void]
      def refused(error, client)
        status = error.status
        now = Clock.now
        if (last = @logged_at[status]) && now - last < INTERVAL
          @suppressed[status] += 1
          return
        end
        @logged_at[status] = now
        more = @suppressed.delete(status)
        NeverBlock.logger.warn do
          hint = HINTS[status]
          "NeverBlock::Server: refused a request from #{client} with #{status}: #{error.message}" \
            "#{"; to raise the limit: #{hint}" if hint}#{" (and #{more} more #{status}s since the last line for it)" if more}"
        end
      end
    end
  end
end
