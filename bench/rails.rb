#!/usr/bin/env ruby
# frozen_string_literal: true

# NeverBlock's 2009 Rails benchmark (one Rails process serving many slow
# requests at once), reproduced with a minimal Rails app (bench/rails/: ActionController::API and
# ActiveRecord, production mode) whose /sleep action runs `select pg_sleep(1)`
# and /fast action `select 1`.
#
#   bench/run rails [options]        -> bench/results/rails.{txt,csv,svg}
#   bench/run rails --quick          smoke run: one run, (b) with N = 20, 10 only
#   bench/run rails --only fast      (c) alone
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
# (c) CPU per request: only /fast (`select 1`), --fast-requests (4000) requests at
#     concurrency 16 and 200 (--fast-concurrency) from keep-alive clients, against one
#     NeverBlock process (defaults: fiber_pool 1000 with the adaptive limit; and with
#     --no-adaptive-limit, the server before it) and one Puma process (its default
#     0:5 threads, and 16 threads: threads matched to c=16). Columns: req/s, p50 and
#     p99 latency seen by the client, the server's CPU per request (utime + stime from
#     /proc/PID/stat of every process in the server's session, before and after the
#     measured window, over the requests answered in it) and its allocations and GC
#     time per request (GC.stat read through GET /_bench/gc, see rails/config.ru).
#     Rounds interleave the servers (a different order each round); each cell is
#     the median of the rounds. Targets (issue 13): NeverBlock's CPU per request
#     <= 0.8x Puma's (default threads) at c=16 and c=200, and its p99 <= Puma's at
#     c=200, ratios of the same run's medians.
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

require_relative "support/harness"
require "net/http"
require "neverblock"
require_relative "support/servers"
require_relative "support/postgres"

module NeverBlockBench
  # Runs the Rails benchmark and reports it. See the file comment.
  class RailsBench
    DEFAULTS = {
      requests: 1000,
      concurrency: 200,
      every: [200, 100, 50, 20, 10],
      puma_workers: [1, 2, 4],
      nb_pool: 200,
      fast_requests: 4000,
      fast_concurrency: [16, 200],
      puma_matched_threads: 16,
      runs: 3,
      out: RESULTS,
      selector: Peers::DEFAULT_SELECTOR
    }.freeze
    QUICK = { every: [20, 10], runs: 1 }.freeze
    PARTS = %w[sleeps mixed fast].freeze
    APP = File.expand_path("rails/config.ru", __dir__)
    PUMA_THREADS = 5 # Puma 8's default maximum on MRI (0:5)

    # One server configuration: `start` takes a port and returns a ServerProcess.
    Setup = Struct.new(:name, :label, :start, keyword_init: true)

    def initialize(options)
      @options = options
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
      rows += measure_fast if @parts.include?("fast")
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

    # @param adaptive [Boolean] false: `--no-adaptive-limit` (up to fiber_pool at once, as before issue 13)
    def neverblock_setup(adaptive: true)
      pool = @options[:nb_pool]
      name = adaptive ? "neverblock" : "neverblock_fixed"
      Setup.new(name: name, label: "NeverBlock::Server, 1 process, #{adaptive ? 'adaptive limit' : 'no adaptive limit'}, " \
                                   "neverblock_postgresql pool #{pool}",
                start: lambda do |port|
                  command = [RbConfig.ruby, File.join(PeerServers::REPO, "exe/neverblock"), "serve", APP,
                             "--workers", "0", "--bind", "tcp://127.0.0.1:#{port}", "--env", "production"]
                  command << "--no-adaptive-limit" unless adaptive
                  ServerProcess.start("neverblock-rails-#{name}", command, port: port,
                                      env: { "NB_RAILS_ADAPTER" => "neverblock_postgresql", "NB_RAILS_POOL" => pool.to_s })
                end)
    end

    def puma_setup(workers:, threads:)
      name = threads == 1 ? "puma_1x1" : "puma_#{workers}x#{threads}"
      mode = workers.zero? ? "1 process (single mode)" : "cluster of #{workers} worker#{'s' if workers > 1}"
      each = workers.zero? ? "" : " each"
      puma_threads = { 1 => "1:1", PUMA_THREADS => nil }.fetch(threads) { "#{threads}:#{threads}" }
      Setup.new(name: name, label: "Puma, #{mode}, #{threads} thread#{'s' if threads > 1}#{each}, postgresql pool #{threads}#{each}",
                start: lambda do |port|
                  PeerServers.puma(APP, port: port, workers: workers, threads: puma_threads,
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
      (@server_pids ||= {})[setup.name] = process.pid
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
      rounds << Array.new([@options[:concurrency], @options[:nb_pool]].min) { "/sleep" } if setup.name.start_with?("neverblock")
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

    # --- part (c): CPU per fast request ------------------------------------------------

    # Each round starts every server once (in a rotated order) and measures
    # each concurrency in it (also rotated).
    def measure_fast
      setups = [neverblock_setup, neverblock_setup(adaptive: false), puma_setup(workers: 0, threads: PUMA_THREADS),
                puma_setup(workers: 0, threads: @options[:puma_matched_threads])]
      concurrencies = @options[:fast_concurrency]
      rows = setups.to_h do |setup|
        [setup, concurrencies.to_h do |c|
          [c, new_row(part: "fast", setup: setup, requests: @options[:fast_requests], concurrency: c, every: 0, fast: [])]
        end]
      end
      @options[:runs].times do |round|
        setups.rotate(round).each do |setup|
          cells = concurrencies.rotate(round).map { |c| rows[setup][c] }
          measure(setup, cells) { |port, row| measure_fast_cell(port, row, setup) }
        end
      end
      rows.values.flat_map(&:values)
    end

    # @return [Hash] drive's outcome, with the server's CPU, GC counters and
    #   the latencies added to the row's :fast list.
    def measure_fast_cell(port, row, setup)
      pid = @server_pids.fetch(setup.name)
      paths = Array.new(row[:requests]) { "/fast" }
      gc_before = gc_counters(port)
      cpu_before = ProcessCpu.session_seconds(pid)
      outcome = drive(port, paths, row[:concurrency], latencies: (latencies = []))
      cpu = ProcessCpu.session_seconds(pid) - cpu_before
      gc_after = gc_counters(port)
      requests = row[:requests].to_f
      sorted = latencies.sort
      row[:fast] << { rate: requests / outcome[:seconds], p50: percentile(sorted, 0.50), p99: percentile(sorted, 0.99),
                      cpu_us: cpu / requests * 1e6, allocations: (gc_after[0] - gc_before[0]) / requests,
                      gc_us: (gc_after[1] - gc_before[1]) * 1000.0 / requests,
                      majors: gc_after[2] - gc_before[2] }
      outcome
    end

    # @return [Array<Integer>] the server process's total_allocated_objects,
    #   GC time (ms), major and minor GC counts (GET /_bench/gc).
    def gc_counters(port)
      Net::HTTP.start("127.0.0.1", port) { |http| http.get("/_bench/gc").body.split.map { |v| Integer(v) } }
    end

    def percentile(sorted, fraction)
      return nil if sorted.empty?

      sorted[((sorted.size - 1) * fraction).round]
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
      errors = outcome[:errors].positive? ? " (#{outcome[:errors]} errors: #{outcome[:error_text]})" : ""
      if (fast = row[:fast]&.last)
        warn format("  %-16s %4d /fast at c=%-3d: %7.1f req/s, p50 %6.1f ms, p99 %7.1f ms, %6.0f us CPU/req, " \
                    "%5.0f allocations/req, %5.0f us GC/req, %d major GCs%s", row[:setup].name, row[:requests],
                    row[:concurrency], fast[:rate], fast[:p50] * 1000, fast[:p99] * 1000, fast[:cpu_us],
                    fast[:allocations], fast[:gc_us], fast[:majors], errors)
      else
        warn format("  %-10s %4d requests, 1 in %-3d to /sleep: %7.3f s, %7.1f req/s%s", row[:setup].name, row[:requests],
                    row[:every], outcome[:seconds], row[:requests] / outcome[:seconds], errors)
      end
    end

    # --- the client --------------------------------------------------------------------

    # Issues `paths` in order from `concurrency` NeverBlock tasks, each on
    # its own keep-alive connection.
    # @param latencies [Array, nil] gets each request's seconds when given
    # @return [Hash] seconds:, errors:, error_text: (the first error)
    def drive(port, paths, concurrency, latencies: nil)
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
              sent = Process.clock_gettime(Process::CLOCK_MONOTONIC) if latencies
              errors << issue(http, path)
              latencies << Process.clock_gettime(Process::CLOCK_MONOTONIC) - sent if latencies
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
      fast = rows.select { |row| row[:part] == "fast" }
      report_sleeps(sleeps) unless sleeps.empty?
      report_mixed(mixed) unless mixed.empty?
      report_fast(fast) unless fast.empty?
      failures = rows.filter_map { |row| row[:failure] || row[:error_text] }.uniq
      puts "\nfailures and errors: #{failures.join('; ')}" unless failures.empty?
      NeverBlockBench.write_results(@options[:out], "rails", %w[part server label requests concurrency sleep_every sleeps seconds seconds_runs
                                                                 req_per_s errors note p50_ms p99_ms cpu_us_per_req allocations_per_req
                                                                 gc_us_per_req cpu_us_runs], csv_rows(rows), chart(sleeps, mixed, fast))
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

    # The median over rounds of one of part (c)'s measures (nil when none).
    def fast_median(row, key)
      row && (values = row[:fast].filter_map { |run| run[key] }).any? ? Samples.new(values).median : nil
    end

    FAST_MEASURES = { rate: "req/s", p50: "p50", p99: "p99", cpu_us: "CPU us/req", allocations: "allocations/req",
                      gc_us: "GC us/req" }.freeze

    def report_fast(rows)
      puts "\n(c) Only GET /fast (select 1): #{@options[:fast_requests]} requests per cell from keep-alive clients; " \
           "server CPU = utime+stime of its processes (/proc) over the measured window / requests; " \
           "allocations and GC time from the server's GC.stat; median of #{@options[:runs]} interleaved rounds."
      setups = rows.map { |row| row[:setup] }.uniq(&:name)
      puts setups.map { |setup| "#{setup.name}: #{setup.label}" }.join("\n")
      table = Table.new(["server", "clients", "req/s", "p50 ms", "p99 ms", "CPU us/req", "allocations/req", "GC us/req",
                         "CPU us/req runs", "p99 ms runs"])
      rows.sort_by { |row| [row[:concurrency], setups.index(row[:setup])] }.each do |row|
        med = FAST_MEASURES.keys.to_h { |key| [key, fast_median(row, key)] }
        if med[:rate].nil?
          table << [row[:setup].name, row[:concurrency], "FAILED", "", "", "", "", "", "", ""]
          next
        end
        table << [row[:setup].name, row[:concurrency], format("%.0f", med[:rate]), format("%.1f", med[:p50] * 1000),
                  format("%.1f", med[:p99] * 1000), format("%.0f", med[:cpu_us]), format("%.0f", med[:allocations]),
                  format("%.0f", med[:gc_us]), Samples.new(row[:fast].map { |run| run[:cpu_us] }).to_s(digits: 0),
                  Samples.new(row[:fast].map { |run| run[:p99] * 1000 }).to_s(digits: 0)]
      end
      puts table
      report_fast_targets(rows)
    end

    # Issue 13's targets, against Puma's defaults (threads 0:5).
    def report_fast_targets(rows)
      find = ->(name, c) { rows.find { |row| row[:setup].name == name && row[:concurrency] == c } }
      puma = "puma_0x#{PUMA_THREADS}"
      puts "\nTargets (issue 13; ratios of this run's medians, NeverBlock with its defaults against #{puma}):"
      table = Table.new(["target", "NeverBlock", "Puma", "ratio", "met"])
      @options[:fast_concurrency].each do |c|
        nb = fast_median(find.call("neverblock", c), :cpu_us)
        pu = fast_median(find.call(puma, c), :cpu_us)
        table << target_row("CPU us/req at c=#{c} <= 0.8x Puma", nb, pu, 0.8, "%.0f")
      end
      c = @options[:fast_concurrency].max
      nb = fast_median(find.call("neverblock", c), :p99)
      pu = fast_median(find.call(puma, c), :p99)
      table << target_row("p99 ms at c=#{c} <= Puma", nb && nb * 1000, pu && pu * 1000, 1.0, "%.1f")
      puts table
    end

    def target_row(text, ours, theirs, ratio, digits)
      return [text, ours || "-", theirs || "-", "-", "unknown"] unless ours && theirs

      [text, format(digits, ours), format(digits, theirs), format("%.2fx", ours / theirs), ours <= theirs * ratio ? "yes" : "NO"]
    end

    def csv_rows(rows)
      rows.map do |row|
        fast = row[:part] == "fast"
        sleeps = { "sleeps" => 10, "fast" => 0 }.fetch(row[:part]) { (row[:requests].to_f / row[:every]).ceil }
        [row[:part], row[:setup].name, row[:setup].label, row[:requests], row[:concurrency], row[:every],
         sleeps, seconds(row)&.round(4), runs_text(row),
         (fast ? fast_median(row, :rate) : rate(row))&.round(2), row[:errors], row[:failure] || row[:error_text],
         fast ? fast_median(row, :p50)&.*(1000)&.round(2) : nil, fast ? fast_median(row, :p99)&.*(1000)&.round(2) : nil,
         fast ? fast_median(row, :cpu_us)&.round(1) : nil, fast ? fast_median(row, :allocations)&.round(1) : nil,
         fast ? fast_median(row, :gc_us)&.round(1) : nil,
         fast ? Samples.new(row[:fast].map { |run| run[:cpu_us] }).to_s(digits: 0) : nil]
      end
    end

    def chart(sleeps, mixed, fast)
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
      unless fast.empty?
        setups = fast.map { |row| row[:setup] }.uniq(&:name)
        cells = ->(key, scale) do
          setups.to_h do |setup|
            [setup.label, @options[:fast_concurrency].map do |c|
              value = fast_median(fast.find { |row| row[:setup].name == setup.name && row[:concurrency] == c }, key)
              value ? (value * scale).round(1) : "failed"
            end]
          end
        end
        categories = @options[:fast_concurrency].map { |c| "#{c} clients" }
        chart.add_panel(title: "only GET /fast (select 1): server CPU us per request (lower is better)",
                        categories: categories, series: cells.call(:cpu_us, 1))
        chart.add_panel(title: "only GET /fast: p99 latency, ms (lower is better; log scale)",
                        categories: categories, series: cells.call(:p99, 1000), log: true)
      end
      chart
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
    opts.on("--fast-requests N", Integer, "requests per cell of (c), only /fast (4000)") { |value| options[:fast_requests] = value }
    opts.on("--fast-concurrency LIST", Array, "client concurrencies of (c) (16,200)") do |list|
      options[:fast_concurrency] = list.map { |value| Integer(value) }
    end
    opts.on("--puma-matched-threads N", Integer, "threads of (c)'s second Puma (16)") { |value| options[:puma_matched_threads] = value }
    opts.on("--runs N", Integer, "runs of everything, the median reported (3)") { |value| options[:runs] = value }
    NeverBlockBench::CommandLine.shared_options(opts, options, results: "rails", variants: "sleeps,mixed,fast (the parts)")
  end
  NeverBlockBench::CommandLine.run(parser, options, defaults: NeverBlockBench::RailsBench::DEFAULTS, quick: NeverBlockBench::RailsBench::QUICK) do |opts|
    NeverBlockBench::RailsBench.new(opts).call
  end
end
