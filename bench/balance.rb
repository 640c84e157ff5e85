#!/usr/bin/env ruby
# frozen_string_literal: true

# Balancing across workers: four each, wrk measuring fast GET / (keep-alive,
# --connections) while GET /burn, 50 ms of CPU, arrives at --burn-rate a
# second on fresh connections. NeverBlock stops accepting at its adaptive
# limit; Puma 8 delays a busy worker's accept (wait_for_less_busy_worker
# 0.005). Target: NeverBlock's fast p99 at or below Puma's.
#
#   bench/run balance                -> bench/results/balance.{txt,csv,svg}
#   bench/run balance --quick        5 s cells, one round

require_relative "support/harness"
require "neverblock"
require_relative "support/servers"
require "net/http"

module NeverBlockBench
  class BalanceBench < Bench
    APP = File.expand_path("support/balance_app.ru", __dir__)
    PUMA_CONFIG = File.expand_path("support/balance_puma.rb", __dir__) # wait_for_less_busy_worker 0.005
    DEFAULTS = { duration: 15, connections: 32, burn_rate: 10, workers: 4, runs: 3 }.freeze
    QUICK = { duration: 5, runs: 1 }.freeze
    ONLY = %w[neverblock puma].freeze # the servers

    # @return [true] (a failed cell raises)
    def call
      results = Hash.new { |hash, key| hash[key] = [] }
      puts NeverBlockBench.header(
        "Balancing across #{@options[:workers]} workers: fast requests (wrk -c #{@options[:connections]}) " \
        "while #{@options[:burn_rate]}/s requests compute 50 ms each",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); puma #{PeerServers.locked_versions['puma']} " \
        "(wait_for_less_busy_worker 0.005); #{Wrk.version}",
        "wrk, the burn requests and the servers on the same machine"
      )
      @options[:runs].times do |round|
        @options[:only].each do |name|
          results[name] << (result = measure(name))
          warn format("  %-10s run %d: fast p50 %.1f ms, p99 %.1f ms, %.0f req/s, %d burns", name, round + 1,
                      result[:p50] * 1000, result[:p99] * 1000, result[:rps], result[:burns])
        end
      end
      report(results)
      true
    end

    private

    def measure(name)
      PeerServers.cluster(name, APP, workers: @options[:workers], puma_config: PUMA_CONFIG) do |server|
        url = "http://127.0.0.1:#{server.port}/"
        Wrk.run(url, connections: @options[:connections], duration: 2) # warm-up
        burns = burning(server.port)
        result = Wrk.run(url, connections: @options[:connections], duration: @options[:duration])
        { p50: result.p50, p99: result.p99, rps: result.requests_per_second, errors: result.errors, burns: burns.call }
      end
    end

    # Starts GET /burn at --burn-rate a second on fresh connections, a thread
    # each. @return [Proc] stops them, answering how many completed
    def burning(port)
      stop = false
      threads = []
      ticker = Thread.new do
        until stop
          threads << Thread.new { Net::HTTP.get_response(URI("http://127.0.0.1:#{port}/burn")) rescue nil } # rubocop:disable Style/RescueModifier
          sleep 1.0 / @options[:burn_rate]
        end
      end
      lambda do
        stop = true
        ticker.join
        threads.count { |thread| thread.join(10)&.value }
      end
    end

    def report(results)
      rows = results.map do |name, runs|
        median = ->(key) { NeverBlockBench.median_of(runs, key) }
        { "server" => name, "fast_p50_ms" => (median.call(:p50) * 1000).round(2), "fast_p99_ms" => (median.call(:p99) * 1000).round(2),
          "fast_req_per_s" => median.call(:rps).round, "errors" => runs.sum { |run| run[:errors] }, "burns" => median.call(:burns) }
      end
      puts "\nmedians of #{@options[:runs]} interleaved runs\n\n#{Table.of(rows, rows.first&.keys || [])}"
      neverblock, puma = %w[neverblock puma].map { |name| rows.find { |row| row["server"] == name }&.fetch("fast_p99_ms") }
      puts "\nNeverBlock's fast p99 / Puma's: #{format('%.2f', neverblock / puma)} (target <= 1)" if neverblock && puma
      chart = NeverBlockBench.chart("Fast requests' latency beside 50 ms CPU requests, #{@options[:workers]} workers")
      chart.pivot("fast requests' p99, ms (lower is better)", "fast_p99_ms", series: "server")
      NeverBlockBench.write_results(@options[:out], "balance", rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::BalanceBench, "balance") if $PROGRAM_NAME == __FILE__
