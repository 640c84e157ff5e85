#!/usr/bin/env ruby
# frozen_string_literal: true

# What observability costs per request: `neverblock serve -w 1` with it off,
# with the metrics on (--control) and with the metrics plus the JSON access
# log, serving hello world and the Rails app's GET /fast (bench/rails/). Each
# cell: a fresh server, --warmup s of wrk, --duration s of `wrk -t1
# -c<connections>`; the CPU per request of the server's session (master and
# worker). Interleaved rounds rotate the variants; medians. Target: metrics
# on <= 1.05x the CPU with them off (the access log has none).
#
#   bench/run observability [--runs 5]   -> bench/results/observability.{txt,csv,svg}
#   bench/run observability --quick      smoke run: 2 s per cell, one round
#   bench/run observability --only off,metrics --apps hello

require_relative "support/harness"
require "neverblock"
require_relative "support/servers"
require_relative "support/postgres"

module NeverBlockBench
  class ObservabilityBench < Bench
    DEFAULTS = { duration: 8, warmup: 2, connections: 16, runs: 5, apps: %w[hello rails] }.freeze
    QUICK = { duration: 2, warmup: 1, runs: 1 }.freeze
    ONLY = %w[off metrics metrics_json_log].freeze # the variants
    METRICS_TARGET = 1.05 # CPU per request with the metrics on / off
    APPS = {
      "hello" => { title: "hello world, GET /", rackup: File.expand_path("support/server_app.ru", __dir__), path: "/", env: {} },
      "rails" => { title: "Rails GET /fast (select 1)", rackup: File.expand_path("rails/config.ru", __dir__), path: "/fast",
                   env: { "NB_RAILS_ADAPTER" => "neverblock_postgresql", "NB_RAILS_POOL" => "16" } }
    }.freeze
    # The extra `neverblock serve` arguments of each variant (the control socket goes in the cell's directory).
    FLAGS = { "off" => [], "metrics" => %w[--control],
              "metrics_json_log" => %w[--control --access-log --access-log-format json] }.freeze

    # @return [Boolean] true when every cell was measured without errors
    def call
      apps = CommandLine.only(@options[:apps], APPS.keys)
      if apps.include?("rails") && (problem = PostgresServer.problem)
        warn "skipping the Rails app: #{problem}"
        apps -= ["rails"]
      end
      puts header
      @runs = Hash.new { |hash, key| hash[key] = [] } # [app, variant] => [{rps:, p99:, cpu_us:, errors:}, ...]
      @failures = {}
      @options[:runs].times do |round|
        apps.each do |app|
          @options[:only].rotate(round % @options[:only].size).each { |variant| measure(app, variant, round) }
        end
      end
      report(apps)
      @failures.empty? && @runs.values.flatten.all? { |run| run[:errors].zero? }
    end

    private

    def header
      NeverBlockBench.header(
        "NeverBlock observability cost: the same server with metrics and logs off and on",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}), io-event #{Machine.gem_version('io-event')}; #{Wrk.version}",
        "neverblock serve APP -w 1 (master + 1 worker); wrk -t1 -c#{@options[:connections]} -d#{@options[:duration]}s " \
        "after a #{@options[:warmup]} s warm-up; #{@options[:runs]} interleaved rounds, medians",
        "CPU us/request: user+system time of the server's whole process session (master and worker) over the measured run / requests"
      )
    end

    def measure(app_name, variant, round)
      app = APPS.fetch(app_name)
      port = ServerProcess.free_port
      warn "#{app_name} #{variant} (run #{round + 1}/#{@options[:runs]}) on 127.0.0.1:#{port}"
      dir = File.join(scratch, "#{app_name}-#{variant}-#{round}").tap { |path| FileUtils.mkdir_p(path) }
      flags = FLAGS.fetch(variant).flat_map { |flag| flag == "--control" ? [flag, "unix://#{dir}/control.sock"] : [flag] }
      PeerServers.neverblock(app[:rackup], port: port, args: ["-w", "1", *flags],
                                           env: app[:env], name: "neverblock-#{app_name}-#{variant}").serve(path: app[:path]) do |process|
        url = "http://127.0.0.1:#{port}#{app[:path]}"
        Wrk.run(url, connections: @options[:connections], duration: @options[:warmup]) if @options[:warmup].positive?
        result = Wrk.run(url, connections: @options[:connections], duration: @options[:duration], pid: process.pid)
        run = { rps: result.requests_per_second, p99: result.p99, errors: result.errors,
                cpu_us: (result.cpu * 1e6 / result.requests if result.requests.positive?) }
        @runs[[app_name, variant]] << run
        warn format("  %9.0f req/s  p99 %.2f ms  %s us CPU/req", run[:rps], (run[:p99] || 0) * 1000, run[:cpu_us]&.round(1) || "-")
      end
    rescue StandardError => e
      warn "  #{app_name} #{variant} FAILED: #{e.message}"
      @failures[[app_name, variant]] ||= e.message.lines.first.strip
    end

    def report(apps)
      median = ->(key, app, variant) { NeverBlockBench.median_of(@runs[[app, variant]], key) }
      rows = apps.product(@options[:only]).map do |app, variant|
        cpu = median.call(:cpu_us, app, variant)
        off = median.call(:cpu_us, app, "off") if @options[:only].include?("off")
        ratio = cpu / off if cpu && off&.positive?
        target = METRICS_TARGET if variant == "metrics"
        { "app" => app, "variant" => variant, "req_per_s" => median.call(:rps, app, variant)&.round,
          "p99_ms" => median.call(:p99, app, variant)&.*(1000)&.round(2), "cpu_us_per_req" => cpu&.round(1),
          "cpu_us_per_req_runs" => NeverBlockBench.listing(@runs[[app, variant]].filter_map { |run| run[:cpu_us] }, 1),
          "cpu_over_off" => ratio&.round(3), "target" => target, "met" => (ratio <= target ? "yes" : "no" if ratio && target),
          "errors" => @runs[[app, variant]].sum { |run| run[:errors] }, "note" => @failures[[app, variant]] }
      end
      rows.group_by { |row| row["app"] }.each do |app, mine|
        puts "\n#{APPS.fetch(app)[:title]}, #{@options[:connections]} connections\n\n"
        puts Table.of(mine, %w[variant req_per_s p99_ms cpu_us_per_req cpu_us_per_req_runs cpu_over_off target met errors])
      end
      chart = NeverBlockBench.chart("What metrics and the JSON access log cost per request (neverblock serve -w 1)",
                                    "wrk -t1 -c#{@options[:connections]} on the same machine; server CPU (master + worker) " \
                                    "per request; medians of #{@options[:runs]} interleaved rounds#{@options[:quick] ? '; quick run' : ''}")
      chart.pivot("server CPU per request, us (lower is better)", "cpu_us_per_req", series: "variant", by: "app")
      NeverBlockBench.write_results(@options[:out], "observability", rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::ObservabilityBench, "observability") if $PROGRAM_NAME == __FILE__
