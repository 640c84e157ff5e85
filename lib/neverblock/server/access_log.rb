# frozen_string_literal: true

require "json"
require "securerandom"
require "time"

module NeverBlock
  class Server
    # The access log (off by default; Server's `access_log:` option): one
    # line per request. Its format (`access_log_format:`):
    #
    # - `:common` (the default): the Common Log Format plus the seconds from
    #   the request's parse to the end of its response,
    #
    #     127.0.0.1 - - [22/Nov/2026:09:00:00 +0000] "GET /path?q HTTP/1.1" 200 6 0.0012
    #
    # - `:json`: one object per line, `{"time", "id", "remote", "method",
    #   "path", "query", "status", "bytes", "duration", "admission_wait",
    #   "worker", "queue_time"}` (seconds; `queue_time` from a front proxy's
    #   `X-Request-Start` or `X-Queue-Start`, `t=SECONDS` or microseconds or
    #   milliseconds since the epoch, else null);
    # - a callable: given that Hash (Symbol keys, `time` a Time), it returns
    #   the line.
    #
    # With `:json` or a formatter every request gets an id: the client's (or
    # front proxy's) `X-Request-Id` when it is one (up to 255 letters,
    # digits, `-`, `_`, `.`, as Rails' RequestId middleware accepts), else a
    # new UUID, which the app then finds in `env["HTTP_X_REQUEST_ID"]` (and
    # Rails uses for its logs). `:common` lines carry no id, so none is made.
    #
    # The bytes are the response body's (without chunk framing); a hijacked
    # connection logs `-` (null in JSON). Inside an event loop the lines are
    # written in batches: `FLUSH_AFTER` seconds after the first line of a
    # batch, or at once when `FLUSH_BYTES` are waiting, and when the server
    # stops; each batch is one `<<` to the target (whole lines, so a Logger
    # writes them as they are, without its prefix). One write per line cost
    # a busy server a system call per request through the scheduler's
    # io_write hook: about a tenth of a hello-world request's CPU. A worker
    # killed outright loses at most the last `FLUSH_AFTER` seconds of lines.
    # A target or a formatter that fails never fails the request: the first
    # failure is reported to {NeverBlock.logger} and later lines are tried
    # again, silently.
    class AccessLog
      # Bytes of the request line that are escaped (quote, backslash, controls, non-ASCII).
      UNSAFE = /["\\\x00-\x1f\x7f-\xff]/n
      # Each byte UNSAFE matches, as it is logged: `\xNN`.
      ESCAPED = Array.new(256) { |byte| [byte].pack("C") }.grep(UNSAFE).to_h { |byte| [byte, format("\\x%02X", byte.ord)] }.freeze
      # A request id kept as the client sent it.
      REQUEST_ID = /\A[A-Za-z0-9\-_.]{1,255}\z/
      FORMATS = %i[common json].freeze
      # Seconds a line may wait for its batch.
      FLUSH_AFTER = 0.05
      # Bytes waiting that are written at once.
      FLUSH_BYTES = 16 * 1024
      # A string JSON takes as it is: printable ASCII but quote and backslash.
      JSON_PLAIN = /\A[\x20\x21\x23-\x5b\x5d-\x7e]*\z/
      private_constant :UNSAFE, :ESCAPED, :REQUEST_ID, :JSON_PLAIN

      # What {#start} keeps of a request until {#write} (formats but :common).
      Entry = Struct.new(:method, :path, :query, :id, :queue_time)

      # @param target [nil, false, true, IO, Logger, #<<] nil or false: no
      #   log; true: `$stdout`; anything else that responds to `<<`.
      # @param format [Symbol, #call] `:common`, `:json` or a formatter (see the class comment).
      # @return [AccessLog, nil]
      # @raise [ArgumentError] for a target without `<<` (or a String: a
      #   path is not opened for you), or an unknown format.
      def self.build(target, format: :common)
        case target
        when nil, false then nil
        when true then new($stdout, format: format)
        else
          if target.is_a?(String) || !target.respond_to?(:<<)
            raise ArgumentError, "access_log must be nil, false, true ($stdout), an IO or a Logger, got " \
                                 "#{target.inspect} (for a file, pass File.open(path, \"a\"))"
          end

          new(target, format: format)
        end
      end

      # @return [Integer, nil] the worker index the JSON lines carry (set in a worker).
      attr_accessor :worker

      # @param target [IO, Logger, #<<]
      # @param format [Symbol, #call]
      # @raise [ArgumentError] for an unknown format.
      def initialize(target, format: :common)
        format = format.to_sym if format.is_a?(String)
        unless FORMATS.include?(format) || format.respond_to?(:call)
          raise ArgumentError, "access_log_format must be :common, :json or a callable, got #{format.inspect}"
        end

        @target = target
        @format = format
        @failed = false
        @batch = +""
        @flushing = false # a task will write the batch
        @second = nil
        @stamp = nil
        @worker = nil
      end

      # Before the app runs (apps may rewrite PATH_INFO): gives the request
      # its id and notes what the line needs.
      # @param env [Hash] a request's Rack env.
      # @return [String, Entry] for :common, the quoted request line.
      def start(env)
        return request_line(env) if @format == :common # no id in its lines: none made (a third of its cost)

        id = env["HTTP_X_REQUEST_ID"]
        env["HTTP_X_REQUEST_ID"] = id = SecureRandom.uuid unless id&.match?(REQUEST_ID)

        Entry.new(env["REQUEST_METHOD"], env["PATH_INFO"], env["QUERY_STRING"], id, queue_time(env))
      end

      # The quoted part of a Common Log Format line.
      # @param env [Hash] a request's Rack env.
      # @return [String] like `GET /path?q HTTP/1.1`.
      def request_line(env)
        query = env["QUERY_STRING"]
        target = query.nil? || query.empty? ? env["PATH_INFO"] : "#{env['PATH_INFO']}?#{query}"
        line = "#{env['REQUEST_METHOD']} #{target} #{env['SERVER_PROTOCOL']}".b
        line.match?(UNSAFE) ? line.gsub(UNSAFE, ESCAPED) : line
      end

      # Adds one line to the batch (outside an event loop: writes it). Never
      # raises (see the class comment).
      # @param remote [String] the client address.
      # @param started [String, Entry] what {#start} returned.
      # @param status [Integer]
      # @param bytes [Integer, String] body bytes, or "-".
      # @param seconds [Float]
      # @param waited [Float] seconds the request waited for its slot.
      # @return [void]
      def write(remote, started, status, bytes, seconds, waited = 0.0)
        @batch << line(remote, started, status, bytes, seconds, waited)
        if @batch.bytesize >= FLUSH_BYTES || !Fiber.scheduler.is_a?(NeverBlock::Scheduler)
          flush
        elsif !@flushing
          @flushing = true
          NeverBlock.spawn(detached: true, internal: true) do # a request's end must not cut the flush
            NeverBlock.sleep(FLUSH_AFTER)
          ensure
            @flushing = false
            flush
          end
        end
      rescue StandardError => e
        failed(e)
      end

      # Writes the lines waiting, if any (the server calls it as it stops).
      # Never raises.
      # @return [void]
      def flush
        return if @batch.empty?

        lines = @batch
        @batch = +""
        @target << lines
      rescue StandardError => e
        failed(e)
      end

      private

      def failed(error)
        return if @failed

        @failed = true
        NeverBlock.logger.error("NeverBlock::Server: the access log failed (#{error.class}: #{error.message}); " \
                                "requests are still served, and further failures are not reported")
      end

      def line(remote, started, status, bytes, seconds, waited)
        return "#{remote} - - [#{timestamp}] \"#{started}\" #{status.to_i} #{bytes} #{format('%.4f', seconds)}\n" if @format == :common

        return json_line(remote, started, status, bytes, seconds, waited) if @format == :json

        entry = { time: Time.now, id: started.id, remote: remote, method: started.method, path: started.path,
                  query: started.query, status: status.to_i, bytes: bytes.is_a?(Integer) ? bytes : nil,
                  duration: seconds.round(6), admission_wait: waited.round(6), worker: @worker,
                  queue_time: started.queue_time&.round(6) }
        text = @format.call(entry).to_s
        text.end_with?("\n") ? text : "#{text}\n"
      end

      # The :json line, written out rather than through a Hash and
      # JSON.generate (half its cost on a hello-world request).
      def json_line(remote, started, status, bytes, seconds, waited)
        queue_time = started.queue_time
        "{\"time\":\"#{iso_time}\",\"id\":#{json(started.id)},\"remote\":#{json(remote)}," \
          "\"method\":#{json(started.method)},\"path\":#{json(started.path)},\"query\":#{json(started.query)}," \
          "\"status\":#{status.to_i},\"bytes\":#{bytes.is_a?(Integer) ? bytes : 'null'}," \
          "\"duration\":#{seconds.round(6)},\"admission_wait\":#{waited.round(6)}," \
          "\"worker\":#{@worker || 'null'},\"queue_time\":#{queue_time ? queue_time.round(6) : 'null'}}\n"
      end

      # A JSON string (or null). Bytes that are not UTF-8 (a raw request
      # target may have any) become U+FFFD rather than failing the line.
      def json(value)
        return "null" if value.nil?
        return "\"#{value}\"" if value.match?(JSON_PLAIN)

        value = value.dup.force_encoding(Encoding::UTF_8).scrub unless value.encoding == Encoding::UTF_8 && value.valid_encoding?
        JSON.generate(value)
      end

      # Now in UTC to the millisecond, ISO 8601.
      def iso_time
        millis = Process.clock_gettime(Process::CLOCK_REALTIME, :millisecond)
        "#{second_stamp(millis / 1000, '%Y-%m-%dT%H:%M:%S.', utc: true)}#{(millis % 1000).to_s.rjust(3, '0')}Z"
      end

      # Seconds since a front proxy's X-Request-Start / X-Queue-Start
      # (`t=1700000000.123`, or the same in milliseconds or microseconds).
      def queue_time(env)
        header = env["HTTP_X_REQUEST_START"] || env["HTTP_X_QUEUE_START"] or return nil
        value = Float(header.delete_prefix("t="), exception: false) or return nil
        value /= 1_000_000.0 if value > 1e14 # microseconds
        value /= 1000.0 if value > 1e11 # milliseconds
        [Time.now.to_f - value, 0.0].max
      end

      # The common format's time, local with its offset.
      def timestamp
        second_stamp(Process.clock_gettime(Process::CLOCK_REALTIME, :second), "%d/%b/%Y:%H:%M:%S %z", utc: false)
      end

      # `second` (epoch) through strftime, made once a second: a log has one
      # format, so one cached stamp serves it.
      def second_stamp(second, pattern, utc:)
        return @stamp if second == @second

        @second = second
        time = Time.at(second)
        @stamp = (utc ? time.utc : time).strftime(pattern)
      end
    end
  end
end
