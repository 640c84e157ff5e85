#!/usr/bin/env ruby
# frozen_string_literal: true

# Slow request bodies beside Puma: --bodies connections each send a POST
# head promising a 100,000-byte body, then one byte every 5 s (about 440 B/s
# in all for 2,200), and are reopened once the server answers them, while
# wrk -c 20 measures ordinary requests (GET /) for --duration s; on one
# worker and on two (support/fault_app.ru). Targets: ordinary requests' p99
# under 100 ms, the trickled requests answered 408 (NeverBlock's
# min_body_rate: within one body_timeout window, 10 s), none holding a
# request slot meanwhile.
#
#   bench/run slowbody                  -> bench/results/slowbody.{txt,csv,svg}
#   bench/run slowbody --quick          smoke run: 5 s, 300 bodies
#   bench/run slowbody --only neverblock --workers 1

require_relative "support/harness"
require "neverblock"
require_relative "support/servers"
require_relative "support/trickle"

module NeverBlockBench
  class SlowBodyBench < Bench
    APP = File.expand_path("support/fault_app.ru", __dir__)
    DEFAULTS = { duration: 30, bodies: 2200, workers: [1, 2] }.freeze
    QUICK = { duration: 5, bodies: 300 }.freeze
    ONLY = %w[neverblock puma].freeze # the servers
    HEAD = "POST / HTTP/1.1\r\nHost: victim\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\nx"
    INTERVAL = 5 # seconds between two bytes of a trickled body

    # @return [Boolean] true when every cell ran
    def call
      @rows = []
      Machine.raise_fd_limit(@options[:bodies] + 4096)
      puts NeverBlockBench.header("NeverBlock::Server with slow request bodies, beside Puma",
                                  "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); " \
                                  "puma #{PeerServers.locked_versions['puma']}; #{Wrk.version}",
                                  "wrk, the trickling clients and the servers on the same machine")
      warn "slowbody: #{@options[:bodies]} POST bodies at a byte per #{INTERVAL} s, wrk -c 20 ordinary requests"
      @options[:workers].each { |workers| @options[:only].each { |name| measure(name, workers) } }
      report
      true
    end

    private

    def measure(name, workers)
      PeerServers.cluster(name, APP, workers: workers) do |server|
        bodies = Trickle.new(server.port, @options[:bodies], HEAD, INTERVAL) { "x" }
        result = Wrk.run("http://127.0.0.1:#{server.port}/", connections: 20, duration: @options[:duration], timeout: 5)
        held = bodies.stop
        @rows << { "workers" => workers, "server" => name, "p50 ms" => (result.p50 * 1000).round(1),
                   "p99 ms" => (result.p99 * 1000).round(1), "req/s" => result.requests_per_second.round,
                   "errors" => result.errors, "trickled answered" => answered(bodies), "open at end" => held }
      end
    end

    # @return [String] e.g. "4400 × 408 after 10.8-15.3 s", or "none"
    def answered(bodies)
      return "none" if bodies.answers.empty?

      after = bodies.answered_after
      statuses = bodies.answers.tally.sort.map { |status, count| "#{count} × #{status}" }.join(", ")
      format("%s after %.1f-%.1f s", statuses, after.min, after.max)
    end

    def report
      columns = @rows.first.keys
      puts "\n#{Table.of(@rows, columns, left: %w[server trickled\ answered])}"
      chart = NeverBlockBench.chart("Ordinary requests' p99 beside #{@options[:bodies]} trickled request bodies",
                                    "wrk -c 20; lower is better")
      @rows.map { |row| row["workers"] }.uniq.each do |workers|
        chart.pivot("#{workers} worker#{'s' unless workers == 1}: p99 ms", "p99 ms", series: "server", where: { "workers" => workers })
      end
      NeverBlockBench.write_results(@options[:out], "slowbody", @rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::SlowBodyBench, "slowbody") if $PROGRAM_NAME == __FILE__
