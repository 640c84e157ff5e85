# frozen_string_literal: true

module NeverBlock
  class Server
    # The access log (off by default; Server's `access_log:` option): one
    # line per request in the Common Log Format, plus the seconds from the
    # request's parse to the end of its response:
    #
    #   127.0.0.1 - - [22/Nov/2026:09:00:00 +0000] "GET /path?q HTTP/1.1" 200 6 0.0012
    #
    # The bytes are the response body's (without chunk framing); a hijacked
    # connection logs `-`. Each line is one `<<` to the target, so a Logger
    # writes it as is (no Logger prefix). A target that fails never fails
    # the request: the first failure is reported to {NeverBlock.logger} and
    # later lines are tried again, silently.
    class AccessLog
      # Bytes of the request line that are escaped (quote, backslash, controls, non-ASCII).
      UNSAFE = /["\\\x00-\x1f\x7f-\xff]/n
      private_constant :UNSAFE

      # @param target [nil, false, true, IO, Logger, #<<] nil or false: no
      #   log; true: `$stdout`; anything else that responds to `<<`.
      # @return [AccessLog, nil]
      # @raise [ArgumentError] for a target without `<<` (or a String: a path is not opened for you).
      def self.build(target)
        case target
        when nil, false then nil
        when true then new($stdout)
        else
          if target.is_a?(String) || !target.respond_to?(:<<)
            raise ArgumentError, "access_log must be nil, false, true ($stdout), an IO or a Logger, got " \
                                 "#{target.inspect} (for a file, pass File.open(path, \"a\"))"
          end

          new(target)
        end
      end

      # @param target [IO, Logger, #<<]
      def initialize(target)
        @target = target
        @failed = false
        @second = nil
        @stamp = nil
      end

      # The quoted part of a line, taken before the app runs (apps may
      # rewrite PATH_INFO).
      # @param env [Hash] a request's Rack env.
      # @return [String] like `GET /path?q HTTP/1.1`.
      def request_line(env)
        query = env["QUERY_STRING"]
        target = query.nil? || query.empty? ? env["PATH_INFO"] : "#{env['PATH_INFO']}?#{query}"
        line = "#{env['REQUEST_METHOD']} #{target} #{env['SERVER_PROTOCOL']}".b
        line.match?(UNSAFE) ? line.gsub(UNSAFE) { |byte| format("\\x%02X", byte.ord) } : line
      end

      # Writes one line. Never raises (see the class comment).
      # @param remote [String] the client address.
      # @param line [String] from {#request_line}.
      # @param status [Integer]
      # @param bytes [Integer, String] body bytes, or "-".
      # @param seconds [Float]
      # @return [void]
      def write(remote, line, status, bytes, seconds)
        @target << "#{remote} - - [#{timestamp}] \"#{line}\" #{status.to_i} #{bytes} #{format('%.4f', seconds)}\n"
      rescue StandardError => e
        return if @failed

        @failed = true
        NeverBlock.logger.error("NeverBlock::Server: the access log failed (#{e.class}: #{e.message}); " \
                                "requests are still served, and further failures are not reported")
      end

      private

      def timestamp
        second = Process.clock_gettime(Process::CLOCK_REALTIME, :second)
        return @stamp if second == @second

        @second = second
        @stamp = Time.at(second).strftime("%d/%b/%Y:%H:%M:%S %z")
      end
    end
  end
end
