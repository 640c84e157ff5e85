#!/usr/bin/env ruby
# frozen_string_literal: true

# NeverBlock::Server under faults beside Puma, each a two-worker cluster
# serving support/fault_app.ru, driven by wrk: slowloris (--loris partial
# heads trickling a header line every 2 s while wrk -c 20 measures; target:
# NeverBlock's p99 under 100 ms; bench/slowbody.rb does the same with
# trickled request bodies), restart (a rolling restart 2 s into 8 s of
# wrk -c 50 keep-alive, --restarts times; target: no failed request) and crash
# (every 50th request kills its worker for --duration s: requests answered and
# lost, lost per worker killed; target: the master still up).
#
#   bench/run faults                 all scenarios (bench/results/faults.{txt,csv,svg})
#   bench/run faults --quick         shorter cells, 3 restarts instead of 10
#   bench/run faults --scenarios slowloris --only neverblock

require_relative "support/harness"
require "neverblock"
require "socket"
require_relative "support/servers"
require_relative "support/trickle"

module NeverBlockBench
  class FaultsBench < Bench
    APP = File.expand_path("support/fault_app.ru", __dir__)
    CRASH_SCRIPT = File.expand_path("support/one_in_50_dies.lua", __dir__)
    DEFAULTS = { duration: 10, loris: 2000, restarts: 10, scenarios: %w[slowloris restart crash] }.freeze
    QUICK = { duration: 5, restarts: 3 }.freeze
    ONLY = %w[neverblock puma].freeze # the servers
    RESTART_SIGNAL = { "neverblock" => "USR2", "puma" => "USR1" }.freeze

    # @return [Boolean] true when every cell ran
    def call
      @rows = []
      Machine.raise_fd_limit(@options[:loris] + 4096)
      puts NeverBlockBench.header("NeverBlock::Server under faults, beside Puma: two workers each",
                                  "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); " \
                                  "puma #{PeerServers.locked_versions['puma']}; #{Wrk.version}",
                                  "wrk, the attackers and the servers on the same machine")
      @options[:scenarios].each { |scenario| send("run_#{scenario}") }
      report
      true
    end

    private

    # Starts each server of --only in turn, a two-worker cluster, yields its name and ServerProcess, stops it.
    def each_server = @options[:only].each { |name| PeerServers.cluster(name, APP, workers: 2) { |server| yield name, server } }

    def run_slowloris
      warn "slowloris: #{@options[:loris]} partial heads, wrk -c 20 ordinary requests"
      each_server do |name, server|
        loris = NeverBlockBench::Trickle.new(server.port, @options[:loris], "GET / HTTP/1.1\r\nHost: victim\r\n", 2) { |i| "X-Loris-#{i}: #{rand(1000)}\r\n" }
        result = Wrk.run("http://127.0.0.1:#{server.port}/", connections: 20, duration: @options[:duration])
        held = loris.stop
        @rows << ["slowloris", name, "p99 ms", (result.p99 * 1000).round(1), "p50 #{(result.p50 * 1000).round(1)} ms, " \
                  "#{result.requests_per_second.round} req/s, errors #{result.errors}, partial heads open #{held}"]
      end
    end

    def run_restart
      warn "rolling restart under wrk -c 50 keep-alive (#{@options[:restarts]} runs each)"
      each_server do |name, server|
        failures = Array.new(@options[:restarts]) do
          wrk = Thread.new { Wrk.run("http://127.0.0.1:#{server.port}/", connections: 50, duration: 8) }
          sleep 2
          Process.kill(RESTART_SIGNAL.fetch(name), server.pid)
          result = wrk.value
          sleep 2 # the restart finished
          result.errors
        end
        @rows << ["restart", name, "failed requests (max of runs)", failures.max, "per run: #{failures.join(' ')}"]
      end
    end

    def run_crash
      warn "crash loop: every 50th request kills its worker, wrk -c 20 for #{@options[:duration]} s"
      each_server do |name, server|
        result = Wrk.run("http://127.0.0.1:#{server.port}/", connections: 20, duration: @options[:duration], timeout: 5, script: CRASH_SCRIPT)
        alive = !server.exited?
        answered = result.requests - result.non2xx
        lost = result.errors - result.non2xx # requests that got no response (wrk counts those apart from `requests`)
        kills = (result.requests + lost) / 50.0 # every 50th request sent was a GET /die
        @rows << ["crash", name, "answered requests", answered,
                  format("lost %d, about %d workers killed: %.1f lost per kill; master up at the end: %s", lost, kills, lost / kills, alive)]
      end
    end

    def report
      columns = %w[scenario server measure value details]
      rows = @rows.map { |row| columns.zip(row).to_h }
      puts "\n#{Table.new(columns, @rows, left: columns - ['value'])}"
      chart = NeverBlockBench.chart("NeverBlock::Server vs Puma under faults (two workers each)")
      @rows.group_by(&:first).each do |scenario, mine|
        chart.pivot("#{scenario}: #{mine.first[2]}", "value", series: "server", where: { "scenario" => scenario })
      end
      NeverBlockBench.write_results(@options[:out], "faults", rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::FaultsBench, "faults") if $PROGRAM_NAME == __FILE__
