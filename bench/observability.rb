#!/usr/bin/env ruby
# frozen_string_literal: true

# What observability costs per request (issue 22, item 5): the same
# `neverblock serve -w 1` (a master and one worker; the control listener is
# the master's) with it off, with the metrics on (`--control`: every request
# counted by status class and method, durations and admission waits into
# histograms, the worker's snapshot in each heartbeat, the master gathering
# them), and with the metrics plus the JSON access log (request ids kept or
# made, one object per request). Two apps: hello world and the 2009 Rails
# benchmark's GET /fast (bench/rails/: ActionController::API, ActiveRecord,
# `select 1` through the neverblock_postgresql adapter, production mode).
#
#   bench/run observability [--runs 5]   -> bench/results/observability.{txt,csv,svg}
#   bench/run observability --quick      smoke run: 2 s per cell, one round
#   bench/run observability --only off,metrics --apps hello
#
# Each cell: a server started afresh, --warmup seconds of wrk, then
# --duration seconds of `wrk -t1 -c<connections>`; the server's CPU per
# request is the user+system time of its whole process session (master and
# worker, from /proc) over the measured run / requests. Rounds are
# interleaved (every variant once per round, in an order that rotates) and
# each cell reports its median. Target: metrics on <= 1.05x the CPU per
# request with them off. The access log has no target: at a ~16 us request,
# making a request id and writing a line cost more than 5 %.

require_relative "support/harness"
require_relative "support/servers"
require_relative "support/postgres"

module NeverBlockBench
  # Runs the observability benchmark and reports it. See the file comment.
  class ObservabilityBench
    DEFAULTS = { duration: 8, warmup: 2, connections: 16, runs: 5, apps: %w[hello rails], out: RESULTS,
                 selector: Peers::DEFAULT_SELECTOR }.freeze
    QUICK = { duration: 2, warmup: 1, runs: 1 }.freeze
    METRICS_TARGET = 1.05 # CPU per request with the metrics on / off
    App = Struct.new(:name, :title, :rackup, :path, :env, :database, keyword_init: true)
    # `flags(dir)`: the extra `neverblock serve` arguments, `dir` a scratch directory for the control socket.
    Variant = Struct.new(:name, :label, :flags, keyword_init: true)

    VARIANTS = [
      Variant.new(name: "off", label: "no control listener, no access log", flags: ->(_dir) { [] }),
      Variant.new(name: "metrics", label: "--control unix://... (cluster /metrics)",
                  flags: ->(dir) { ["--control", "unix://#{dir}/control.sock"] }),
      Variant.new(name: "metrics_json_log", label: "--control plus --access-log --access-log-format json",
                  flags: ->(dir) { ["--control", "unix://#{dir}/control.sock", "--access-log", "--access-log-format", "json"] })
    ].freeze

    def initialize(options)
      @options = options
      @variants = CommandLine.select(VARIANTS, @options[:only])
      @apps = CommandLine.select(apps, @options[:apps])
    end

    # @return [Boolean] true when every cell was measured without errors
    def call
      @selector = Peers.use_selector(@options[:selector])
      return warn("wrk is not installed; run bin/setup") && false unless Wrk.version

      if @apps.any?(&:database) && (problem = PostgresServer.problem)
        warn "skipping the Rails app: #{problem}"
        @apps = @apps.reject(&:database)
      end
      puts header
      cells = @apps.product(@variants).map { |app, variant| Cell.new("#{app.name} #{variant.name}", app: app, variant: variant) }
      @options[:runs].times do |round|
        @apps.each do |app|
          mine = cells.select { |cell| cell[:app].equal?(app) }
          mine.rotate(round % mine.size).each { |cell| measure(cell, round) }
        end
      end
      report(cells)
      cells.all? { |cell| cell.failures.empty? && cell.runs.all? { |run| run.errors.zero? } }
    ensure
      ServerProcess.stop_all
    end

    private

    def apps
      rails_env = { "NB_RAILS_ADAPTER" => "neverblock_postgresql", "NB_RAILS_POOL" => "16" }
      [App.new(name: "hello", title: "Hello world", rackup: File.expand_path("support/server_app.ru", __dir__), path: "/", env: {}),
       App.new(name: "rails", title: "Rails GET /fast (select 1)", rackup: File.expand_path("rails/config.ru", __dir__),
               path: "/fast", env: rails_env, database: true)]
    end

    def header
      db = @apps.any?(&:database) ? "\nPostgreSQL: #{PostgresServer.description}; #{PostgresServer.driver_description}" : ""
      <<~TEXT
        NeverBlock observability cost: the same server with metrics and logs off and on
        #{Machine.ruby_description}
        neverblock #{NeverBlock::VERSION} (#{Checkout.description}), io-event #{Machine.gem_version('io-event')}, selector #{@selector}; #{Wrk.version}#{db}
        #{Machine.description}; wrk and the server on the same machine
        neverblock serve APP -w 1 (master + 1 worker); wrk -t1 -c#{@options[:connections]} -d#{@options[:duration]}s after a #{@options[:warmup]} s warm-up; #{@options[:runs]} interleaved rounds, medians
        CPU us/request: user+system time of the server's whole process session (master and worker) over the measured run / requests (from /proc)
        load average at start: #{Machine.load_average}
      TEXT
    end

    def measure(cell, round)
      app, variant = cell[:app], cell[:variant] # rubocop:disable Style/ParallelAssignment
      port = ServerProcess.free_port
      warn "#{cell.name} (run #{round + 1}/#{@options[:runs]}) on 127.0.0.1:#{port}"
      Dir.mktmpdir("neverblock-bench-observability-") do |dir|
        command = [RbConfig.ruby, File.join(PeerServers::REPO, "exe/neverblock"), "serve", app.rackup, "--workers", "1",
                   "--bind", "tcp://127.0.0.1:#{port}", "--env", "production", *variant.flags.call(dir)]
        process = ServerProcess.start("neverblock-#{cell.name.tr(' ', '-')}", command, port: port, env: app.env)
        begin
          process.wait_until_ready(path: app.path)
          url = "http://127.0.0.1:#{port}#{app.path}"
          Wrk.run(url, connections: @options[:connections], duration: @options[:warmup]) if @options[:warmup].positive?
          cpu_before = ProcessCpu.session_seconds(process.pid)
          result = Wrk.run(url, connections: @options[:connections], duration: @options[:duration])
          cpu = ProcessCpu.session_seconds(process.pid) - cpu_before
          cell.runs << result
          cell.cpu << cpu * 1e6 / result.requests if result.requests.positive?
          warn format("  %9.0f req/s  p99 %.2f ms  %s us CPU/req%s", result.requests_per_second, (result.p99 || 0) * 1000,
                      cell.cpu.last&.round(1) || "-", result.errors.positive? ? "  (#{result.error_text})" : "")
        ensure
          process.stop
        end
      end
    rescue StandardError => e
      warn "  #{cell.name} FAILED: #{e.message}"
      cell.failures << e.message.lines.first.strip
    end

    def cpu(cell) = cell && !cell.cpu.empty? ? Samples.new(cell.cpu).median : nil
    def rate(cell) = cell.runs.empty? ? nil : Samples.new(cell.runs.map(&:requests_per_second)).median
    def p99(cell) = cell.runs.empty? ? nil : Samples.new(cell.runs.filter_map(&:p99)).median

    # @return [Float, nil] this cell's CPU per request over the same app's with everything off
    def over_off(cells, cell)
      off = cpu(cells.find { |other| other[:app].equal?(cell[:app]) && other[:variant].name == "off" })
      mine = cpu(cell)
      mine && off&.positive? ? mine / off : nil
    end

    def report(cells)
      puts "\nload average at end: #{Machine.load_average}"
      puts "\nVariants:"
      @variants.each { |variant| puts "  #{variant.name}: #{variant.label}" }
      rows = cells.map do |cell|
        ratio = over_off(cells, cell)
        target = METRICS_TARGET if cell[:variant].name == "metrics"
        [cell[:app].name, cell[:variant].name, rate(cell)&.round, p99(cell)&.*(1000)&.round(2), cpu(cell)&.round(1),
         cell.cpu.map { |value| value.round(1) }.join(" "), ratio&.round(3), target, (ratio <= target ? "yes" : "no" if ratio && target),
         cell.failures.first]
      end
      @apps.each do |app|
        puts "\n#{app.title}: GET #{app.path}, #{@options[:connections]} connections"
        table = Table.new(["variant", "req/s", "p99 ms", "CPU us/req", "CPU us/req runs", "CPU / off", "target", "met"])
        rows.select { |row| row[0] == app.name }.each do |row|
          table << [row[1], row[2] || "FAILED", row[3] || "-", row[4] || "-", row[5], row[6] ? format("%.3fx", row[6]) : "",
                    row[7] ? "<= #{row[7]}x" : "", row[8].to_s]
        end
        puts table
      end
      NeverBlockBench.write_results(@options[:out], "observability", %w[app variant req_per_s p99_ms cpu_us_per_req cpu_us_per_req_runs
                                                                         cpu_over_off target met note], rows, chart(cells))
    end

    def chart(cells)
      chart = SvgChart.new(title: "What metrics and the JSON access log cost per request (neverblock serve -w 1)",
                           subtitle: ["ruby #{RUBY_VERSION}; #{Machine.description}; wrk -t1 -c#{@options[:connections]} on the same machine" \
                                      "#{@options[:quick] ? '; quick run' : ''}",
                                      "server CPU (master + worker) per request; medians of #{@options[:runs]} interleaved rounds"])
      series = @variants.to_h do |variant|
        [variant.name, @apps.map { |app| cpu(cells.find { |c| c[:app].equal?(app) && c[:variant].equal?(variant) })&.round(1) || "failed" }]
      end
      chart.add_panel(title: "server CPU per request, us (lower is better)", categories: @apps.map(&:title), series: series)
    end
  end
end

if $PROGRAM_NAME == __FILE__
  require "neverblock"
  NeverBlockBench::CommandLine.main(NeverBlockBench::ObservabilityBench, "observability", variants: "off,metrics,metrics_json_log") do |opts, options|
    opts.on("--duration SECONDS", Integer, "measured seconds per cell (8)") { |value| options[:duration] = value }
    opts.on("--warmup SECONDS", Integer, "wrk warm-up seconds before each cell, 0 for none (2)") { |value| options[:warmup] = value }
    opts.on("--connections N", Integer, "wrk's keep-alive connections (16)") { |value| options[:connections] = value }
    opts.on("--runs N", Integer, "interleaved rounds; each cell's median is reported (5)") { |value| options[:runs] = value }
    opts.on("--apps LIST", Array, "hello,rails (both)") { |list| options[:apps] = list }
  end
end
