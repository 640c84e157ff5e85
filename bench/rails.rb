#!/usr/bin/env ruby
# frozen_string_literal: true

# NeverBlock's 2009 Rails benchmark (one Rails process serving many slow
# requests at once), reproduced with a minimal Rails app (bench/rails/: ActionController::API and
# ActiveRecord, production mode) whose /sleep action runs `select pg_sleep(1)`
# and /fast action `select 1`.
#
#   bench/run rails [options]        -> bench/results/rails.{txt,csv,svg}
#   bench/run rails --quick          smoke run: one run, (b) with N = 20, 10 only
#
# (a) Ten concurrent /sleep requests: one NeverBlock::Server process
#     (`adapter: neverblock_postgresql`, pool --nb-pool) against Puma with one
#     process and one thread (stock `postgresql` adapter, pool 1). 2009: ~1 s
#     against ~10 s.
# (b) The 2009 mixed workload: --requests (1000) requests at concurrency
#     --concurrency (200); request i (from 0) goes to /sleep when i % N == 0,
#     to /fast otherwise, for N in --every (200,100,50,20,10). One NeverBlock
#     process against Puma clusters of 1, 2 and 4 workers (`puma -w N`, Puma's
#     default threads 0:5, stock adapter with pool 5: a connection per thread).
#
# Everything is measured --runs (3) times, each server started afresh per
# run, and the median run is reported (the others beside it).
#
# The servers: NeverBlock through `neverblock serve bench/rails/config.ru -w 0`
# (exe/neverblock, this checkout, fiber_pool 1000, main bundle); Puma 8 from
# bench/gemfiles/servers.gemfile (vendor/bundle-servers), ActiveRecord 7.2 on both.
# The client is this process: NeverBlock tasks, one per concurrent request,
# each with a keep-alive Net::HTTP connection, taking the next request number
# until all are issued; req/s = requests / wall time from the first request to
# the last response. Each server is warmed up before it is measured (its
# database connections opened, see #warm_up).
#
# Client, servers and PostgreSQL share one 2-CPU machine that others use too:
# the numbers are noisy. bench/run starts PostgreSQL with bin/databases.

$LOAD_PATH.unshift(File.expand_path("../lib", __dir__))
begin
  require "bundler/setup"
rescue LoadError, StandardError => e
  warn "bundler/setup failed (#{e.message.lines.first&.strip}); using installed gems"
end
require "optparse"
require "fileutils"
require "net/http"
require "neverblock"
require_relative "support/checkout"
require_relative "support/command_line"
require_relative "support/csv_file"
require_relative "support/machine"
require_relative "support/peer_servers"
require_relative "support/peers"
require_relative "support/postgres_server"
require_relative "support/samples"
require_relative "support/server_process"
require_relative "support/svg_chart"
require_relative "support/table"

module NeverBlockBench
  # Runs the Rails benchmark and reports it. See the file comment.
  class RailsBench
    DEFAULTS = {
      requests: 1000,
      concurrency: 200,
      every: [200, 100, 50, 20, 10],
      puma_workers: [1, 2, 4],
      nb_pool: 200,
      runs: 3,
      only: nil,
      out: File.expand_path("results", __dir__),
      selector: Peers::DEFAULT_SELECTOR
    }.freeze
    QUICK = { every: [20, 10], runs: 1 }.freeze
    PARTS = %w[sleeps mixed].freeze
    APP = File.expand_path("rails/config.ru", __dir__)
    PUMA_THREADS = 5 # Puma 8's default maximum on MRI (0:5)

    # One server configuration: `start` takes a port and returns a ServerProcess.
    Setup = Struct.new(:name, :label, :start, keyword_init: true)

    def initialize(options)
      @options = DEFAULTS.merge(options[:quick] ? QUICK : {}).merge(options.reject { |k, _| k == :quick })
      @parts = @options[:only] || PARTS
      unknown = @parts - PARTS
      raise OptionParser::InvalidArgument, "unknown part(s) #{unknown.join(', ')}; use #{PARTS.join(',')}" unless unknown.empty?
    end

    # @return [Boolean] true when every request of every measurement got a 200
    def call
      Machine.raise_fd_limit(8192)
      @selector = Peers.use_selector(@options[:selector])
      return false unless ready?

      puts header
      rows = []
      rows += measure_sleeps if @parts.include?("sleeps")
      rows += measure_mixed if @parts.include?("mixed")
      report(rows)
      rows.all? { |row| row[:failure].nil? && row[:errors].zero? }
    ensure
      ServerProcess.stop_all
    end

    private

    def ready?
      if (problem = PostgresServer.problem || PeerServers.problem)
        warn problem
        return false
      end
      true
    end

    def header
      versions = PeerServers.locked_versions
      <<~TEXT
        NeverBlock Rails benchmark: the 2009 "one process" Rails numbers, reproduced
        #{Machine.ruby_description}
        rails #{Machine.gem_version('railties')} (ActionController::API + ActiveRecord #{Machine.gem_version('activerecord')}, production); neverblock #{NeverBlock::VERSION} (#{Checkout.description}, io-event #{Machine.gem_version('io-event')}, selector #{@selector}); puma #{versions['puma']} (rails #{versions['railties']}); #{PostgresServer.driver_description}
        PostgreSQL: #{PostgresServer.description}
        #{Machine.description}; client, servers and PostgreSQL on the same machine, which others use too: the numbers are noisy
        client: NeverBlock tasks with keep-alive Net::HTTP connections, in this process
        load average at start: #{Machine.load_average}
      TEXT
    end

    # --- servers ---------------------------------------------------------------------

    def neverblock_setup
      pool = @options[:nb_pool]
      Setup.new(name: "neverblock", label: "NeverBlock::Server, 1 process, neverblock_postgresql pool #{pool}",
                start: lambda do |port|
                  PeerServers.neverblock_cli(APP, port: port, name: "neverblock-rails",
                                                  env: { "NB_RAILS_ADAPTER" => "neverblock_postgresql",
                                                         "NB_RAILS_POOL" => pool.to_s })
                end)
    end

    def puma_setup(workers:, threads:)
      name = threads == 1 ? "puma_1x1" : "puma_#{workers}x#{threads}"
      mode = workers.zero? ? "1 process (single mode)" : "cluster of #{workers} worker#{'s' if workers > 1}"
      each = workers.zero? ? "" : " each"
      Setup.new(name: name, label: "Puma, #{mode}, #{threads} thread#{'s' if threads > 1}#{each}, postgresql pool #{threads}#{each}",
                start: lambda do |port|
                  PeerServers.puma(APP, port: port, workers: workers, threads: threads == 1 ? "1:1" : nil,
                                        name: "puma-rails-#{name}",
                                        env: { "NB_RAILS_ADAPTER" => "postgresql", "NB_RAILS_POOL" => threads.to_s })
                end)
    end

    # Starts the server, warms it up, yields the port, stops it.
    # @return [Object] the block's value
    def with_server(setup)
      port = ServerProcess.free_port
      warn "#{setup.label} on 127.0.0.1:#{port}"
      process = setup.start.call(port)
      begin
        process.wait_until_ready(path: "/fast", timeout: 120)
        warm_up(port, setup, process)

        yield port
      ensure
        process.stop
      end
    end

    # Opens the database connections the measurements will use and runs
    # the code paths once: two rounds of --concurrency /fast requests, and
    # for NeverBlock first as many concurrent /sleep requests as its pool
    # can hold at once (the mixed workload holds up to that many at a time;
    # opening one costs milliseconds of CPU for SCRAM on both sides). Puma
    # holds one connection per thread, which the /fast rounds open.
    def warm_up(port, setup, process)
      rounds = []
      rounds << Array.new([@options[:concurrency], @options[:nb_pool]].min) { "/sleep" } if setup.name == "neverblock"
      rounds += Array.new(2) { Array.new(@options[:concurrency]) { "/fast" } }
      rounds.each do |paths|
        warm = drive(port, paths, @options[:concurrency])
        raise "warm-up failed: #{warm[:error_text]}\n#{process.log_tail}" if warm[:errors].positive?
      end
    end

    # --- part (a): ten concurrent one-second queries -----------------------------------

    def measure_sleeps
      rows = [neverblock_setup, puma_setup(workers: 0, threads: 1)].map do |setup|
        new_row(part: "sleeps", setup: setup, requests: 10, concurrency: 10, every: 1)
      end
      @options[:runs].times do
        rows.each { |row| measure(row.fetch(:setup), [row]) { |port| drive(port, Array.new(10) { "/sleep" }, 10) } }
      end
      rows
    end

    # --- part (b): the mixed workload --------------------------------------------------

    # Each server is started once per run for all N values.
    def measure_mixed
      setups = [neverblock_setup] + @options[:puma_workers].map { |w| puma_setup(workers: w, threads: PUMA_THREADS) }
      rows = setups.to_h do |setup|
        [setup, @options[:every].map do |every|
          new_row(part: "mixed", setup: setup, requests: @options[:requests], concurrency: @options[:concurrency], every: every)
        end]
      end
      @options[:runs].times do
        rows.each do |setup, cells|
          measure(setup, cells) do |port, row|
            drive(port, Array.new(row[:requests]) { |i| (i % row[:every]).zero? ? "/sleep" : "/fast" }, row[:concurrency])
          end
        end
      end
      rows.values.flatten
    end

    def new_row(**fields)
      fields.merge(runs: [], errors: 0, error_text: nil, failure: nil)
    end

    # Starts the setup's server once and measures each row in it, the block
    # driving the requests. A server that fails fails its rows (this run).
    def measure(setup, rows)
      with_server(setup) do |port|
        rows.each { |row| record(row, yield(port, row)) }
      end
    rescue StandardError => e
      warn "  #{setup.name} FAILED: #{e.message}"
      rows.each { |row| row[:failure] ||= e.message.lines.first.strip }
    end

    def record(row, outcome)
      row[:runs] << outcome[:seconds]
      row[:errors] += outcome[:errors]
      row[:error_text] ||= outcome[:error_text]
      warn format("  %-10s %4d requests, 1 in %-3d to /sleep: %7.3f s, %7.1f req/s%s", row[:setup].name, row[:requests],
                  row[:every], outcome[:seconds], row[:requests] / outcome[:seconds],
                  outcome[:errors].positive? ? " (#{outcome[:errors]} errors: #{outcome[:error_text]})" : "")
    end

    # --- the client --------------------------------------------------------------------

    # Issues `paths` in order from `concurrency` NeverBlock tasks, each on
    # its own keep-alive connection.
    # @return [Hash] seconds:, errors:, error_text: (the first error)
    def drive(port, paths, concurrency)
      errors = []
      # No stall warnings: on a busy machine the client's loop is starved now
      # and then, which says nothing about the servers.
      NeverBlock.run(stall_threshold: nil) do
        following = 0
        started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        tasks = Array.new([concurrency, paths.size].min) do
          NeverBlock.spawn do
            http = Net::HTTP.new("127.0.0.1", port, nil)
            http.read_timeout = 300
            http.keep_alive_timeout = 60
            while following < paths.size
              path = paths[following]
              following += 1
              errors << issue(http, path)
            end
          ensure
            http.finish if http.started?
          end
        end
        NeverBlock.wait_all(tasks)
        { seconds: Process.clock_gettime(Process::CLOCK_MONOTONIC) - started,
          errors: errors.compact.size, error_text: errors.compact.first }
      end
    end

    # @return [String, nil] what went wrong, nil for a 200
    def issue(http, path)
      http.start unless http.started?
      response = http.get(path)
      response.code == "200" ? nil : "HTTP #{response.code} for #{path}"
    rescue StandardError => e
      http.finish if http.started?
      "#{e.class}: #{e.message}"
    end

    # --- reporting ---------------------------------------------------------------------

    # @return [Float, nil] the median run's seconds
    def seconds(row)
      row && Samples.new(row[:runs]).median
    end

    # @return [Float, nil] requests/s of the median run
    def rate(row)
      (value = seconds(row)) ? row[:requests] / value : nil
    end

    def runs_text(row)
      Samples.new(row[:runs]).to_s(digits: 3)
    end

    def report(rows)
      puts "\nload average at end: #{Machine.load_average}"
      sleeps = rows.select { |row| row[:part] == "sleeps" }
      mixed = rows.select { |row| row[:part] == "mixed" }
      report_sleeps(sleeps) unless sleeps.empty?
      report_mixed(mixed) unless mixed.empty?
      failures = rows.filter_map { |row| row[:failure] || row[:error_text] }.uniq
      puts "\nfailures and errors: #{failures.join('; ')}" unless failures.empty?
      FileUtils.mkdir_p(@options[:out])
      csv = write_csv(rows)
      svg = write_svg(sleeps, mixed)
      puts "\nwrote #{CommandLine.relative(csv)} and #{CommandLine.relative(svg)}"
    end

    def report_sleeps(rows)
      puts "\n(a) Ten concurrent GET /sleep (select pg_sleep(1)) through Rails; target: NeverBlock about 1 s (>= 9 req/s), " \
           "Puma with one thread about 1 req/s. 2009: 1.08 s against 10.25 s."
      table = Table.new(["server", "seconds", "req/s", "errors", "target", "met", "runs (s)"])
      rows.each do |row|
        nb = row[:setup].name == "neverblock"
        rate = rate(row)
        table << [row[:setup].label, seconds(row) ? format("%.3f", seconds(row)) : "FAILED",
                  rate ? format("%.2f", rate) : "-", row[:errors], nb ? ">= 9 req/s" : "~1 req/s",
                  nb && rate ? (rate >= 9 ? "yes" : "no") : "", runs_text(row)]
      end
      puts table
    end

    def report_mixed(rows)
      setups = rows.map { |row| row[:setup] }.uniq(&:name)
      puts "\n(b) Mixed workload: #{@options[:requests]} requests at concurrency #{@options[:concurrency]}, every request " \
           "runs select 1 and one in N runs select pg_sleep(1) instead; requests/s (higher is better)."
      puts setups.map { |setup| "#{setup.name}: #{setup.label}" }.join("\n")
      puma = setups.map(&:name).grep(/\Apuma/)
      table = Table.new(["one in N sleeps"] + setups.map(&:name) + puma.map { |name| "NeverBlock / #{name}" })
      @options[:every].each do |every|
        found = setups.to_h { |setup| [setup.name, rows.find { |row| row[:setup].name == setup.name && row[:every] == every }] }
        nb = rate(found["neverblock"])
        table << ["1 in #{every} (#{(@options[:requests].to_f / every).ceil} sleeps)"] +
                 setups.map { |setup| (value = rate(found[setup.name])) ? format("%.1f", value) : "FAILED" } +
                 puma.map { |name| nb && rate(found[name]) ? format("%.2fx", nb / rate(found[name])) : "-" }
      end
      puts table
      puts "runs (s): " + rows.map { |row| "#{row[:setup].name} 1/#{row[:every]} #{runs_text(row)}" }.join("; ") if @options[:runs] > 1
    end

    def write_csv(rows)
      headers = %w[part server label requests concurrency sleep_every sleeps seconds seconds_runs req_per_s errors note]
      lines = rows.map do |row|
        [row[:part], row[:setup].name, row[:setup].label, row[:requests], row[:concurrency], row[:every],
         row[:part] == "sleeps" ? 10 : (row[:requests].to_f / row[:every]).ceil, seconds(row)&.round(4), runs_text(row),
         rate(row)&.round(2), row[:errors], row[:failure] || row[:error_text]]
      end
      CsvFile.write(File.join(@options[:out], "rails.csv"), headers, lines)
    end

    def write_svg(sleeps, mixed)
      chart = SvgChart.new(title: "Rails #{Machine.gem_version('railties')} on one NeverBlock process vs Puma",
                           subtitle: ["ruby #{RUBY_VERSION}; ActionController::API + ActiveRecord; " \
                                      "neverblock_postgresql (NeverBlock) vs postgresql (Puma)",
                                      "#{Machine.description}; client, servers and PostgreSQL on the same machine"])
      unless sleeps.empty?
        chart.add_panel(title: "10 concurrent requests running select pg_sleep(1), seconds (lower is better)",
                        categories: ["10 x pg_sleep(1)"],
                        series: sleeps.to_h { |row| [row[:setup].label, [seconds(row)&.round(3) || "failed"]] })
      end
      unless mixed.empty?
        setups = mixed.map { |row| row[:setup] }.uniq(&:name)
        chart.add_panel(title: "#{@options[:requests]} requests at concurrency #{@options[:concurrency]}, " \
                               "one in N runs pg_sleep(1): requests/s",
                        categories: @options[:every].map { |every| "1 in #{every}" },
                        series: setups.to_h do |setup|
                          [setup.label, @options[:every].map do |every|
                            rate(mixed.find { |row| row[:setup].name == setup.name && row[:every] == every })&.round(1) || "failed"
                          end]
                        end)
      end
      chart.write(File.join(@options[:out], "rails.svg"))
    end
  end
end

if $PROGRAM_NAME == __FILE__
  $stdout.sync = true
  options = {}
  parser = OptionParser.new do |opts|
    opts.banner = "Usage: ruby bench/rails.rb [options]"
    opts.on("--requests N", Integer, "requests per mixed-workload cell (1000)") { |value| options[:requests] = value }
    opts.on("--concurrency N", Integer, "requests at once in the mixed workload (200)") { |value| options[:concurrency] = value }
    opts.on("--every LIST", Array, "N values: one in N requests sleeps (200,100,50,20,10)") do |list|
      options[:every] = list.map { |value| Integer(value) }
    end
    opts.on("--puma-workers LIST", Array, "Puma cluster sizes (1,2,4)") do |list|
      options[:puma_workers] = list.map { |value| Integer(value) }
    end
    opts.on("--nb-pool N", Integer, "NeverBlock's ActiveRecord pool (200)") { |value| options[:nb_pool] = value }
    opts.on("--runs N", Integer, "runs of everything, the median reported (3)") { |value| options[:runs] = value }
    opts.on("--quick", "smoke run: --every 20,10 --runs 1") { options[:quick] = true }
    NeverBlockBench::CommandLine.shared_options(opts, options, results: "rails", variants: "sleeps,mixed (the parts)")
  end
  NeverBlockBench::CommandLine.run(parser) { NeverBlockBench::RailsBench.new(options).call }
end
