#!/usr/bin/env ruby
# frozen_string_literal: true

# NeverBlock's 2009 Rails benchmark with a minimal Rails app (bench/rails/:
# ActionController::API, ActiveRecord, production; /sleep runs `select
# pg_sleep(1)`, /fast `select 1`), neverblock_postgresql under one NeverBlock
# process against postgresql under Puma:
# (a) ten concurrent /sleep, against Puma with one thread (2009: ~1 s vs ~10 s);
# (b) 2009's mixed workload: --requests at --concurrency, one in N to /sleep
#     (--every), against Puma clusters of --puma-workers, Puma's IO mode
#     (puma_io) and, as Puma 8.0.2's IO mode stays at 5 threads after its
#     first lull (puma#3958), Puma with 205 threads;
# (c) only /fast at each --fast-concurrency: req/s, p50, p99, and the server's
#     CPU, allocations and GC time per request, NeverBlock with and without its
#     adaptive limit against Puma with 5 and 16 threads, and the app alone
#     (app_alone: its /fast called in-process by as many NeverBlock tasks, no
#     HTTP: the floor any server adds its CPU to). Targets: CPU per request
#     <= 0.8x Puma's (0:5), p99 <= Puma's at the highest concurrency.
# Every server starts afresh and warmed up per round; cells are medians of
# --runs. The client is this process: a NeverBlock task per concurrent
# request, each on a keep-alive Net::HTTP connection.
#
#   bench/run rails [options]        -> bench/results/rails.{txt,csv,svg}
#   bench/run rails --quick          smoke run: one run, fewer requests, (b) with N = 20, 10 only
#   bench/run rails --only fast      (c) alone

require_relative "support/harness"
require "net/http"
require "open3"
require "neverblock"
require_relative "support/servers"
require_relative "support/postgres"

module NeverBlockBench
  class RailsBench < Bench
    DEFAULTS = { requests: 1000, concurrency: 200, every: [200, 100, 50, 20, 10], puma_workers: [1, 2, 4], nb_pool: 200, puma_io_threads: 200,
                 fast_requests: 4000, fast_concurrency: [16, 200], puma_matched_threads: 16, runs: 3 }.freeze
    QUICK = { every: [20, 10], runs: 1, requests: 200, fast_requests: 400 }.freeze
    ONLY = %w[sleeps mixed fast].freeze # the parts
    APP = File.expand_path("rails/config.ru", __dir__)
    PUMA_THREADS = 5 # Puma 8's default maximum on MRI (0:5)
    PUMA_IO_CONFIG = File.expand_path("support/puma_io.rb", __dir__)
    ALONE = File.expand_path("rails/alone.rb", __dir__)
    # One server configuration: `start` takes a port and returns a ServerProcess;
    # or, for no server, `alone` takes a cell and measures it.
    Setup = Struct.new(:name, :label, :start, :alone, keyword_init: true)

    # @return [Boolean] true when every request of every measurement got a 200
    def call
      Machine.raise_fd_limit(8192)
      @selector = Peers.use_epoll
      return warn(PostgresServer.problem) if PostgresServer.problem

      puts header
      cells = @options[:only].flat_map { |part| send("measure_#{part}") }
      report(cells)
      cells.all? { |cell| cell.failures.empty? && cell[:errors].empty? }
    end

    private

    def header
      v = PeerServers.locked_versions
      NeverBlockBench.header(
        'NeverBlock Rails benchmark: the 2009 "one process" Rails numbers, reproduced',
        "rails #{Machine.gem_version('railties')} (ActionController::API + ActiveRecord #{Machine.gem_version('activerecord')}, " \
        "production); neverblock #{NeverBlock::VERSION} (#{Checkout.description}, io-event #{Machine.gem_version('io-event')}, " \
        "selector #{@selector}); puma #{v['puma']} (rails #{v['railties']}); #{PostgresServer.driver_description}",
        "PostgreSQL: #{PostgresServer.description}",
        "client: NeverBlock tasks with keep-alive Net::HTTP connections, in this process; client, servers and PostgreSQL " \
        "share the machine, which others use too: the numbers are noisy"
      )
    end

    def env(adapter, pool, extra = {}) = { "NB_RAILS_ADAPTER" => adapter, "NB_RAILS_POOL" => pool.to_s }.merge(extra)

    # adaptive false: `--no-adaptive-limit` (up to fiber_pool requests at once)
    def neverblock(adaptive: true)
      name, pool = adaptive ? "neverblock" : "neverblock_fixed", @options[:nb_pool] # rubocop:disable Style/ParallelAssignment
      args = ["-w", "0", *("--no-adaptive-limit" unless adaptive)]
      Setup.new(name: name,
                label: "NeverBlock::Server, 1 process, #{'no ' unless adaptive}adaptive limit, neverblock_postgresql pool #{pool}",
                start: ->(port) { PeerServers.neverblock(APP, port: port, args: args, env: env("neverblock_postgresql", pool)) })
    end

    def puma(workers:, threads:)
      name = threads == 1 ? "puma_1x1" : "puma_#{workers}x#{threads}"
      mode = workers.zero? ? "1 process (single mode)" : "#{workers} workers"
      puma_threads = { 1 => "1:1", PUMA_THREADS => nil }.fetch(threads) { "#{threads}:#{threads}" }
      Setup.new(name: name, label: "Puma, #{mode}, #{threads} threads and a postgresql pool of #{threads} per process",
                start: lambda do |port|
                  PeerServers.puma(APP, port: port, workers: workers, threads: puma_threads, env: env("postgresql", threads))
                end)
    end

    # Puma 8's IO mode in one process: 0:5 threads, plus up to io_threads for
    # requests marked IO-bound (/sleep); a pool connection for every thread.
    def puma_io
      io_threads = @options[:puma_io_threads]
      pool = PUMA_THREADS + io_threads
      vars = env("postgresql", pool, "NB_BENCH_PUMA_IO_THREADS" => io_threads.to_s)
      Setup.new(name: "puma_io", label: "Puma IO mode, 1 process (single mode), threads 0:#{PUMA_THREADS} + max_io_threads " \
                                        "#{io_threads}, postgresql pool #{pool}",
                start: ->(port) { PeerServers.puma(APP, port: port, config: PUMA_IO_CONFIG, env: vars) })
    end

    def cells_for(part, setups, values, requests:, concurrency: nil)
      setups.to_h do |setup|
        [setup, values.map do |value|
          Cell.new("#{setup.name} #{part} #{value}", part: part, setup: setup, requests: requests, errors: [], fast: [],
                                                     concurrency: concurrency || value, every: concurrency ? value : 0)
        end]
      end
    end

    # (a) Ten concurrent /sleep requests, a server started per cell and run.
    def measure_sleeps
      cells = cells_for("sleeps", [neverblock, puma(workers: 0, threads: 1)], [1], requests: 10, concurrency: 10)
      measure(cells) { |port, _cell| drive(port, Array.new(10) { "/sleep" }, 10) }
    end

    # (b) The mixed workload; each server started once per run for all N values.
    def measure_mixed
      setups = [neverblock] + @options[:puma_workers].map { |workers| puma(workers: workers, threads: PUMA_THREADS) } +
               [puma_io, puma(workers: 0, threads: PUMA_THREADS + @options[:puma_io_threads])]
      cells = cells_for("mixed", setups, @options[:every], requests: @options[:requests], concurrency: @options[:concurrency])
      measure(cells) do |port, cell|
        drive(port, Array.new(cell[:requests]) { |i| (i % cell[:every]).zero? ? "/sleep" : "/fast" }, cell[:concurrency])
      end
    end

    # The app with no server (bench/rails/alone.rb): its /fast called in a
    # child Ruby by as many NeverBlock tasks as the cell has clients, over
    # neverblock_postgresql. The floor every server adds its own CPU to.
    def app_alone
      pool = @options[:nb_pool]
      Setup.new(name: "app_alone", label: "no server: the app's /fast called by NeverBlock tasks in one process " \
                                          "(bench/rails/alone.rb), neverblock_postgresql pool #{pool}",
                alone: lambda do |cell|
                  out, status = Open3.capture2(env("neverblock_postgresql", pool), RbConfig.ruby, ALONE,
                                               cell[:requests].to_s, cell[:concurrency].to_s)
                  raise "bench/rails/alone.rb failed (#{status})" unless status.success?

                  seconds, cpu_us, allocations, gc_us = out.split.map { |value| Float(value) }
                  cell[:fast] << { rate: cell[:requests] / seconds, cpu_us: cpu_us, allocations: allocations, gc_us: gc_us }
                  { seconds: seconds, errors: [] }
                end)
    end

    # (c) Only /fast, with the server's CPU, allocations and GC time; rounds rotate the order.
    def measure_fast
      setups = [neverblock, neverblock(adaptive: false), puma(workers: 0, threads: PUMA_THREADS),
                puma(workers: 0, threads: @options[:puma_matched_threads]), app_alone]
      cells = cells_for("fast", setups, @options[:fast_concurrency], requests: @options[:fast_requests])
      measure(cells, rotate: true) do |port, cell, pid|
        gc_before, cpu_before = gc_counters(port), ProcessCpu.session_seconds(pid) # rubocop:disable Style/ParallelAssignment
        outcome = drive(port, Array.new(cell[:requests]) { "/fast" }, cell[:concurrency], latencies: (latencies = []))
        cpu, gc_after = ProcessCpu.session_seconds(pid) - cpu_before, gc_counters(port) # rubocop:disable Style/ParallelAssignment
        n = cell[:requests].to_f
        cell[:fast] << { rate: n / outcome[:seconds], p50: NeverBlockBench.percentile(latencies, 0.50),
                         p99: NeverBlockBench.percentile(latencies, 0.99),
                         cpu_us: cpu / n * 1e6, allocations: (gc_after[0] - gc_before[0]) / n,
                         gc_us: (gc_after[1] - gc_before[1]) * 1000.0 / n, majors: gc_after[2] - gc_before[2] }
        outcome
      end
    end

    # Measures `cells` (setup => its cells) --runs times: per run each setup's
    # server started, warmed up, measured with the block (port, cell, pid =>
    # drive's outcome) for each of its cells, stopped. A server that fails
    # fails its cells for that run. @return [Array<Cell>]
    def measure(cells, rotate: false)
      @options[:runs].times do |round|
        (rotate ? cells.keys.rotate(round) : cells.keys).each do |setup|
          if setup.alone
            warn setup.label
            (rotate ? cells[setup].rotate(round) : cells[setup]).each { |cell| record(cell, setup.alone.call(cell)) }
            next
          end
          warn "#{setup.label} on 127.0.0.1:#{port = ServerProcess.free_port}"
          setup.start.call(port).serve(path: "/fast", timeout: 120) do |process|
            warn "  #{PeerServers.check_ruby(process)}"
            warm_up(port, setup, process)
            (rotate ? cells[setup].rotate(round) : cells[setup]).each { |cell| record(cell, yield(port, cell, process.pid)) }
          end
        rescue StandardError => e
          warn "  #{setup.name} FAILED: #{e.message}"
          cells[setup].each { |cell| cell.failures << e.message.lines.first.strip if cell.failures.empty? }
        end
      end
      cells.values.flatten
    end

    # Opens the connections the measurements use (each costs milliseconds of
    # SCRAM) and runs the code paths once: for NeverBlock as many concurrent
    # /sleep as its pool holds, then two rounds of --concurrency /fast (which
    # open Puma's connection per thread).
    def warm_up(port, setup, process)
      rounds = Array.new(2) { Array.new(@options[:concurrency]) { "/fast" } }
      rounds.unshift(Array.new([@options[:concurrency], @options[:nb_pool]].min) { "/sleep" }) if setup.name.start_with?("neverblock")
      rounds.each do |paths|
        errors = drive(port, paths, @options[:concurrency])[:errors]
        raise "warm-up failed: #{errors.first}\n#{process.log_tail}" unless errors.empty?
      end
    end

    # Keeps a run's seconds and errors; its progress line goes to stderr.
    def record(cell, outcome)
      cell.runs << outcome[:seconds]
      cell[:errors].concat(outcome[:errors])
      measured = cell[:fast].last&.map { |key, value| "#{key} #{value.round(4)}" }&.join(", ") || "1 in #{cell[:every]} to /sleep"
      warn format("  %s, %d requests at c=%d: %.3f s; %s; %d errors %s", cell[:setup].name, cell[:requests], cell[:concurrency],
                  outcome[:seconds], measured, outcome[:errors].size, outcome[:errors].first)
    end

    # @return [Array<Integer>] the server's total_allocated_objects, GC time (ms), major and minor GC counts
    def gc_counters(port) = Net::HTTP.start("127.0.0.1", port) { |http| http.get("/_bench/gc").body.split.map { |v| Integer(v) } }

    # Issues `paths` in order from `concurrency` NeverBlock tasks, each on its own keep-alive connection.
    # @param latencies [Array, nil] gets each request's seconds when given
    # @return [Hash] seconds:, errors: (what went wrong, one String per failed request)
    def drive(port, paths, concurrency, latencies: nil)
      errors = []
      # No stall warnings: a busy machine starves the client's loop now and then.
      NeverBlock.run(stall_threshold: nil) do
        queue = paths.dup
        started = NeverBlockBench.now
        tasks = Array.new([concurrency, paths.size].min) do
          NeverBlock.spawn do
            http = Net::HTTP.new("127.0.0.1", port, nil)
            http.read_timeout = 300
            http.keep_alive_timeout = 60
            while (path = queue.shift)
              sent = NeverBlockBench.now
              error = issue(http, path) and errors << error
              latencies&.<<(NeverBlockBench.now - sent)
            end
          ensure
            http.finish if http.started?
          end
        end
        NeverBlock.wait_all(tasks)
        { seconds: NeverBlockBench.now - started, errors: errors }
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

    def fast?(cell) = cell[:part] == "fast"
    # The median over runs of one of part (c)'s measures; nil when none.
    def fast_median(cell, key) = cell && NeverBlockBench.median_of(cell[:fast], key)
    # requests/s: of the median run, or for part (c) the median of the runs'.
    def rate(cell) = cell && (fast?(cell) ? fast_median(cell, :rate) : cell.median&.then { |s| cell[:requests] / s })
    def find(cells, name, key, value) = cells.find { |cell| cell[:setup].name == name && cell[key] == value }
    def setups(cells) = cells.map { |cell| cell[:setup] }.uniq(&:name)

    def report(cells)
      rows = cells.map { |cell| csv_row(cells, cell) }
      cells.group_by { |cell| cell[:part] }.each { |part, mine| send("report_#{part}", mine, rows) }
      failures = cells.flat_map { |cell| cell.failures + cell[:errors].first(1) }.uniq
      puts "\nfailures and errors: #{failures.join('; ')}" unless failures.empty?
      chart = NeverBlockBench.chart("Rails #{Machine.gem_version('railties')} on one NeverBlock process vs Puma",
                                    "ActionController::API + ActiveRecord; neverblock_postgresql (NeverBlock) vs postgresql (Puma)")
      chart.pivot("10 concurrent requests running select pg_sleep(1), seconds (lower is better)", "seconds", series: "label",
                  where: { "part" => "sleeps" })
      chart.pivot("#{@options[:requests]} requests at concurrency #{@options[:concurrency]}, one in N runs pg_sleep(1): " \
                  "requests/s by N", "req_per_s", by: "sleep_every", series: "server", where: { "part" => "mixed" })
      fast = { "part" => "fast" }
      chart.pivot("only GET /fast (select 1): server CPU us per request by clients (lower is better)", "cpu_us_per_req",
                  by: "concurrency", series: "server", where: fast)
      chart.pivot("only GET /fast: p99 latency, ms, by clients (lower is better)", "p99_ms", by: "concurrency", series: "server",
                  where: fast.merge("over_http" => true), log: true)
      NeverBlockBench.write_results(@options[:out], "rails", rows, chart)
    end

    def report_sleeps(_cells, rows)
      puts "\n(a) Ten concurrent GET /sleep (select pg_sleep(1)) through Rails; target: NeverBlock about 1 s (>= 9 req/s), " \
           "Puma with one thread about 1 req/s. 2009: 1.08 s against 10.25 s."
      puts Table.of(rows.select { |row| row["part"] == "sleeps" }, %w[label seconds req_per_s errors seconds_runs note])
    end

    def report_mixed(cells, _rows)
      setups = setups(cells)
      puts "\n(b) Mixed workload: #{@options[:requests]} requests at concurrency #{@options[:concurrency]}, every request " \
           "runs select 1 and one in N runs select pg_sleep(1) instead; requests/s (higher is better)."
      puts setups.map { |setup| "#{setup.name}: #{setup.label}" }
      puma = setups.map(&:name).grep(/\Apuma/)
      table = Table.new(["one in N sleeps"] + setups.map(&:name) + puma.map { |name| "NeverBlock / #{name}" })
      @options[:every].each do |every|
        rates = setups.to_h { |setup| [setup.name, rate(find(cells, setup.name, :every, every))] }
        nb = rates["neverblock"]
        table << ["1 in #{every} (#{(@options[:requests].to_f / every).ceil} sleeps)"] + rates.values.map { |value| value ? format("%.1f", value) : "FAILED" } +
                 puma.map { |name| nb && rates[name] ? format("%.2fx", nb / rates[name]) : "-" }
      end
      puts table
    end

    FAST_TABLE = %w[server concurrency req_per_s p50_ms p99_ms cpu_us_per_req allocations_per_req gc_us_per_req cpu_us_runs
                    cpu_vs_puma_0x5 p99_vs_puma_0x5].freeze

    def report_fast(cells, rows)
      puts "\n(c) Only GET /fast (select 1): #{@options[:fast_requests]} requests per cell from keep-alive clients; " \
           "server CPU = utime+stime of its processes (/proc) over the measured window / requests; " \
           "allocations and GC time from the server's GC.stat; median of #{@options[:runs]} interleaved rounds."
      setups = setups(cells)
      puts setups.map { |setup| "#{setup.name}: #{setup.label}" }
      fast = rows.select { |row| row["part"] == "fast" }
      puts Table.of(fast.sort_by { |row| [row["concurrency"], setups.index { |setup| setup.name == row["server"] }] }, FAST_TABLE)
    end

    # A cell's medians and runs; for part (c) NeverBlock's ratios to Puma with its default threads.
    def csv_row(cells, cell)
      fast = ->(key, scale = 1, digits = 1) { fast_median(cell, key)&.*(scale)&.round(digits) if fast?(cell) }
      puma = find(cells, "puma_0x#{PUMA_THREADS}", :concurrency, cell[:concurrency]) if fast?(cell)
      versus_puma = ->(key) { (fast_median(cell, key) / fast_median(puma, key)).round(2) if fast_median(cell, key) && fast_median(puma, key) }
      { "part" => cell[:part], "server" => cell[:setup].name, "label" => cell[:setup].label, "requests" => cell[:requests],
        "concurrency" => cell[:concurrency], "sleep_every" => cell[:every],
        "sleeps" => { "sleeps" => 10, "fast" => 0 }.fetch(cell[:part]) { (cell[:requests].to_f / cell[:every]).ceil },
        "seconds" => cell.median&.round(3), "seconds_runs" => cell.listing(3), "req_per_s" => rate(cell)&.round(2),
        "errors" => cell[:errors].size, "note" => cell.failures.first || cell[:errors].first, "p50_ms" => fast.call(:p50, 1000),
        "p99_ms" => fast.call(:p99, 1000), "cpu_us_per_req" => fast.call(:cpu_us, 1, 0), "allocations_per_req" => fast.call(:allocations, 1, 0),
        "gc_us_per_req" => fast.call(:gc_us, 1, 0),
        "cpu_us_runs" => (NeverBlockBench.listing(cell[:fast].map { |run| run[:cpu_us] }, 0) if fast?(cell)),
        "cpu_vs_puma_0x5" => versus_puma.call(:cpu_us), "p99_vs_puma_0x5" => versus_puma.call(:p99),
        "over_http" => cell[:setup].alone.nil? }
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::RailsBench, "rails") if $PROGRAM_NAME == __FILE__
