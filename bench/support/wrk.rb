# frozen_string_literal: true

require "open3"

module NeverBlockBench
  # Runs wrk (Debian's package, 4.1) against a URL and reads its report:
  # requests/s, the latency percentiles of --latency, and the errors.
  #
  #   result = Wrk.run("http://127.0.0.1:9292/", connections: 100, duration: 10)
  #   result.requests_per_second  # => 38211.4
  #   result.p99                  # => 0.0123 (seconds)
  module Wrk
    # One run's numbers. Latencies are seconds; `errors` counts socket
    # errors (connect, read, write, timeout) and non-2xx/3xx responses.
    Result = Struct.new(:requests_per_second, :requests, :p50, :p90, :p99, :errors, :error_text, :output,
                        keyword_init: true)

    # Latency units wrk prints => seconds.
    UNITS = { "us" => 1e-6, "ms" => 1e-3, "s" => 1.0, "m" => 60.0 }.freeze

    module_function

    # @return [String, nil] "wrk 4.1.0" (nil when wrk is not installed)
    def version
      out, = Open3.capture2e("wrk", "--version")
      out[/wrk (?:debian\/)?([\d.]+)/, 1]&.then { |v| "wrk #{v}" }
    rescue SystemCallError
      nil
    end

    # @param url [String]
    # @param connections [Integer] keep-alive connections (wrk -c)
    # @param duration [Numeric] seconds (wrk -d; whole seconds)
    # @param threads [Integer] wrk -t
    # @param timeout [Numeric] seconds before wrk counts a request as timed out
    # @return [Result]
    # @raise [RuntimeError] when wrk fails or prints no requests/s
    def run(url, connections:, duration:, threads: 1, timeout: 10)
      command = ["wrk", "-t#{threads}", "-c#{connections}", "-d#{duration.ceil}s", "--timeout", "#{timeout.ceil}s",
                 "--latency", url]
      output, status = capture(command)
      raise "#{command.join(' ')} failed (#{status}):\n#{output}" unless status.success?

      parse(output)
    end

    # Like Open3.capture2e, but an interrupt (Ctrl-C, SIGTERM) stops wrk
    # at once instead of waiting for its run to end.
    # @return [Array(String, Process::Status)]
    def capture(command)
      Open3.popen2e(*command) do |stdin, out, thread|
        stdin.close
        begin
          [out.read, thread.value]
        rescue Exception # rubocop:disable Lint/RescueException -- stop wrk, then re-raise
          begin
            Process.kill("TERM", thread.pid)
          rescue Errno::ESRCH
            nil
          end
          raise
        end
      end
    end

    # @param output [String] what `wrk --latency` printed
    # @return [Result]
    # @raise [RuntimeError] when there is no Requests/sec line
    def parse(output)
      rate = output[%r{^Requests/sec:\s+([\d.]+)}, 1] or raise "no Requests/sec in wrk's output:\n#{output}"
      socket = output[/Socket errors: (.*)$/, 1]
      socket_errors = socket ? socket.scan(/\d+/).sum(&:to_i) : 0
      non2xx = output[/Non-2xx or 3xx responses: (\d+)/, 1].to_i
      Result.new(requests_per_second: Float(rate), requests: output[/(\d+) requests in/, 1].to_i,
                 p50: percentile(output, 50), p90: percentile(output, 90), p99: percentile(output, 99),
                 errors: socket_errors + non2xx,
                 error_text: [("socket errors: #{socket}" if socket), ("non-2xx/3xx: #{non2xx}" if non2xx.positive?)]
                   .compact.join("; "),
                 output: output)
    end

    # @return [Float, nil] seconds
    def percentile(output, which)
      match = output.match(/^\s+#{which}%\s+([\d.]+)(us|ms|s|m)\b/)
      match && Float(match[1]) * UNITS.fetch(match[2])
    end
  end
end
