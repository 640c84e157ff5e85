#!/usr/bin/env ruby
# frozen_string_literal: true

# NeverBlock::Server against Puma, Falcon, Thin, iodine and agoo (and nginx
# as the hardware reference), each as one serving process on this machine in
# the same run, driven by Debian's wrk (`wrk -t1 -cN -dXs --latency`,
# keep-alive): requests/s and latency, and the server's CPU time and (for
# NeverBlock) allocations per request.
#
#   bench/run server [options]           full run (bench/results/server.{txt,csv,svg})
#   bench/run server --quick             smoke run: 3 s per cell, 1 s warm-up
#   bench/run server --only neverblock,puma --scenarios hello
#
# Scenarios (bench/support/server_app.rb is the app for all servers):
#   hello  GET / -> "Hello world\n", --connections (100) keep-alive connections;
#          NeverBlock vs Puma, Falcon, Thin, iodine, agoo and nginx
#   sleep  GET /sleep: `sleep 0.01` then a short body, --io-connections (256);
#          under NeverBlock and Falcon a fiber sleeps, under Puma a thread
#   pg     GET /pg: `select pg_sleep(0.01)` through a database pool, --io-connections
#          (256). NeverBlock: NeverBlock::Postgres.pool(size: --db-pool); Falcon: a
#          fair fiber-safe pool (bench/support/handoff_pool.rb) of the same size;
#          Puma: one connection per thread (its default 5 threads, so 5 connections)
#   Thin, iodine, agoo and nginx run only hello: the first three run the app on
#   one thread, so a blocking sleep or query would serialise every request;
#   nginx has no app.
#
# CPU per request: user + system time of the server's whole session (its
# forked workers and threads too; bench/support/process_cpu.rb), read from
# /proc just before and just after the measured wrk run, over the requests
# wrk completed. On a shared machine this moves far less than req/s, which
# depends on whatever else had the CPUs. Allocations per request (NeverBlock
# only): GC.stat(:total_allocated_objects) of the server process before and
# after the same run, asked over a Unix socket (bench/support/gc_probe.rb);
# "-" for the peers.
#
# Targets: req/s ratios (NeverBlock's req/s over the peer's, issues 10-12):
# hello >= 1.2x Puma, >= 2x Falcon, >= Thin; sleep and pg >= 10x Puma,
# >= 1.2x Falcon. CPU ratios (NeverBlock's CPU per request over the peer's,
# issue 13): hello <= 0.5x Puma, <= 1.5x iodine.
#
# The servers (versions in the header; peers from bench/gemfiles/servers.gemfile):
#   NeverBlock  bench/support/neverblock_server.rb: NeverBlock::Server, workers: 0,
#               fiber_pool: --fiber-pool (1000), the main bundle
#   Puma        puma -e production (single mode, default threads 0:5)
#   Falcon      falcon serve --count 1 (a supervisor and one forked server process)
#   Thin        thin start -e production
#   iodine      iodine -w 1 -t 1 (one worker, one app thread)
#   agoo        agoo -w 1 (the app on the main thread, HTTP on agoo's C threads)
#   nginx       worker_processes 1; master_process off; return 200 "Hello world\n"
# NeverBlock and Falcon run on the same io-event selector, --selector (epoll).
#
# Each server is started with setsid, polled until it answers, warmed up with
# wrk for --warmup seconds per scenario (this also opens the database
# connections), measured for --duration seconds, then its session is killed and
# its port checked free. --runs N repeats everything N times, interleaved
# (every server once per round), and reports the median of each number:
# req/s, CPU and allocations per request; latencies are those of the run
# with the median req/s.
#
# wrk uses one thread and the servers one process, on a 2-CPU machine where
# other work may be running: the numbers are noisy; the header and footer
# show the load average.
#
# The pg scenario needs PostgreSQL: bench/run starts one with bin/databases
# (max_connections 300). Run directly without NEVERBLOCK_PG_*, it is skipped.

require_relative "support/harness"
require "tmpdir"
require_relative "support/servers"
require_relative "support/postgres"

module NeverBlockBench
  # Runs the server benchmark and reports it. See the file comment.
  class ServerBench
    DEFAULTS = {
      duration: 10,
      warmup: 2,
      connections: 100,
      io_connections: 256,
      db_pool: 64,
      fiber_pool: 1000,
      runs: 1,
      only: nil,
      scenarios: nil,
      out: File.expand_path("results", __dir__),
      selector: Peers::DEFAULT_SELECTOR
    }.freeze
    QUICK = { duration: 3, warmup: 1 }.freeze

    APP = File.expand_path("support/server_app.ru", __dir__)

    # What one scenario measures; `targets` maps a peer to the req/s ratio
    # NeverBlock should reach over it (at least), `cpu_targets` to the ratio
    # of CPU per request NeverBlock should stay under.
    Scenario = Struct.new(:name, :path, :title, :connections, :targets, :cpu_targets, :database, keyword_init: true)

    # One server: `start` takes a port and returns a ServerProcess;
    # `scenarios` are the names it runs; `gc_socket` (NeverBlock), given a
    # port, where the server answers its allocation count.
    Server = Struct.new(:name, :label, :start, :scenarios, :gc_socket, keyword_init: true)

    def initialize(options)
      @options = DEFAULTS.merge(options[:quick] ? QUICK : {}).merge(options.reject { |k, _| k == :quick })
      @quick = options[:quick]
      @scenarios = pick(all_scenarios, @options[:scenarios], "scenario")
      @servers = pick(all_servers, @options[:only], "server")
    end

    # Measures every server in every scenario, prints the tables, writes CSV and SVG.
    #
    # @return [Boolean] true when every server started and NeverBlock
    #   answered every request (a peer's errors are reported, not fatal)
    def call
      Machine.raise_fd_limit(8192)
      @selector = Peers.use_selector(@options[:selector])
      return false unless ready?

      @scratch = Dir.mktmpdir("neverblock-bench-server-")
      puts header
      results = measure_all
      report(results)
      results.all? do |result|
        result[:failure].nil? && (result[:server].name != "neverblock" || result[:runs].all? { |run| run.errors.zero? })
      end
    ensure
      ServerProcess.stop_all
      FileUtils.rm_rf(@scratch) if @scratch
    end

    private

    def all_scenarios
      [
        Scenario.new(name: "hello", path: "/", title: "Hello world, keep-alive", connections: @options[:connections],
                     targets: { "puma" => 1.2, "falcon" => 2.0, "thin" => 1.0 },
                     cpu_targets: { "puma" => 0.5, "iodine" => 1.5 }),
        Scenario.new(name: "sleep", path: "/sleep", title: "IO-bound: sleep 0.01",
                     connections: @options[:io_connections], targets: { "puma" => 10.0, "falcon" => 1.2 }, cpu_targets: {}),
        Scenario.new(name: "pg", path: "/pg", title: "IO-bound: select pg_sleep(0.01) through a pool",
                     connections: @options[:io_connections], targets: { "puma" => 10.0, "falcon" => 1.2 }, cpu_targets: {},
                     database: true)
      ]
    end

    def all_servers
      pool = @options[:db_pool]
      all = %w[hello sleep pg]
      versions = PeerServers.locked_versions
      [
        Server.new(name: "neverblock", label: "NeverBlock #{NeverBlock::VERSION} (1 process, fiber_pool #{@options[:fiber_pool]}; " \
                                             "pg: NeverBlock::Postgres.pool(size: #{pool}))",
                   scenarios: all,
                   gc_socket: ->(port) { File.join(@scratch, "neverblock-#{port}-gc.sock") },
                   start: lambda do |port|
                     PeerServers.neverblock(APP, port: port, fiber_pool: @options[:fiber_pool],
                                                 env: { "NB_BENCH_DB" => "neverblock", "NB_BENCH_DB_POOL" => pool.to_s,
                                                        "NB_BENCH_GC_SOCKET" => File.join(@scratch, "neverblock-#{port}-gc.sock") })
                   end),
        Server.new(name: "puma", label: "Puma #{versions['puma']} (single mode, default threads 0:5; pg: a connection per thread)",
                   scenarios: all,
                   start: ->(port) { PeerServers.puma(APP, port: port, env: { "NB_BENCH_DB" => "threads" }) }),
        Server.new(name: "falcon", label: "Falcon #{versions['falcon']} (async #{versions['async']}, --count 1; " \
                                          "pg: fair fiber pool of #{pool})",
                   scenarios: all,
                   start: lambda do |port|
                     PeerServers.falcon(APP, port: port, env: { "NB_BENCH_DB" => "fibers", "NB_BENCH_DB_POOL" => pool.to_s })
                   end),
        Server.new(name: "thin", label: "Thin #{versions['thin']} (eventmachine #{versions['eventmachine']})",
                   scenarios: %w[hello], start: ->(port) { PeerServers.thin(APP, port: port) }),
        Server.new(name: "iodine", label: "iodine #{versions['iodine']} (-w 1 -t 1)",
                   scenarios: %w[hello], start: ->(port) { PeerServers.iodine(APP, port: port) }),
        Server.new(name: "agoo", label: "agoo #{versions['agoo']} (-w 1, the app on one thread)",
                   scenarios: %w[hello], start: ->(port) { PeerServers.agoo(APP, port: port) }),
        Server.new(name: "nginx", label: "#{PeerServers.nginx_version} (1 worker, no master; return 200)",
                   scenarios: %w[hello], start: ->(port) { PeerServers.nginx(port: port, dir: @scratch) })
      ]
    end

    def pick(all, names, what)
      return all unless names

      unknown = names - all.map(&:name)
      raise OptionParser::InvalidArgument, "unknown #{what}(s) #{unknown.join(', ')}" unless unknown.empty?

      all.select { |item| names.include?(item.name) }
    end

    # @return [Boolean] false (after a warning) when nothing can be measured
    def ready?
      unless Wrk.version
        warn "wrk is not installed; run bin/setup"
        return false
      end
      peers = @servers.map(&:name) & %w[puma falcon thin iodine agoo]
      if peers.any? && (problem = PeerServers.problem)
        warn problem
        return false
      end
      if @scenarios.any?(&:database) && PostgresServer.problem
        warn "skipping the pg scenario: #{PostgresServer.problem}"
        @scenarios = @scenarios.reject(&:database)
      end
      true
    end

    def header
      versions = PeerServers.locked_versions
      db = @scenarios.any?(&:database) ? "\nPostgreSQL: #{PostgresServer.description}; #{PostgresServer.driver_description}" : ""
      <<~TEXT
        NeverBlock::Server benchmark: one serving process per server, same machine, same run
        #{Machine.ruby_description}
        neverblock #{NeverBlock::VERSION} (#{Checkout.description}), io-event #{Machine.gem_version('io-event')}, llhttp #{Machine.gem_version('llhttp')}; peers: puma #{versions['puma']}, falcon #{versions['falcon']} (async #{versions['async']}, io-event #{versions['io-event']}), thin #{versions['thin']}, iodine #{versions['iodine']}, agoo #{versions['agoo']}, rack #{versions['rack']}; #{PeerServers.nginx_version}; #{Wrk.version}
        #{Machine.description}; wrk and the servers on the same machine
        io-event selector for NeverBlock and Falcon: #{@selector} (IO_EVENT_SELECTOR, NEVERBLOCK_SELECTOR)#{db}
        wrk -t1 -c<connections> -d#{@options[:duration]}s --latency after a #{@options[:warmup]} s warm-up; #{runs_text}
        CPU us/request: user+system time of the server's process session over the measured run / requests (from /proc)
        The machine is shared and has 2 CPUs (wrk takes about one): treat req/s differences under ~20 % as noise;
        CPU per request moves less (it counts only the server's own time).
        load average at start: #{Machine.load_average}
      TEXT
    end

    def runs_text
      return "one run per cell" if @options[:runs] == 1

      "#{@options[:runs]} interleaved rounds; medians per cell (latencies: the run with the median req/s)"
    end

    # --- measuring --------------------------------------------------------------------

    def measure_all
      results = @servers.flat_map do |server|
        @scenarios.select { |s| server.scenarios.include?(s.name) }
                  .map { |scenario| { server: server, scenario: scenario, runs: [], cpu: [], allocations: [], failure: nil } }
      end
      @options[:runs].times do |run|
        @servers.each do |server|
          cells = results.select { |result| result[:server].equal?(server) }
          measure_server(server, cells, run) unless cells.empty?
        end
      end
      results
    end

    # Starts the server once for all its scenarios in this run.
    def measure_server(server, cells, run)
      port = ServerProcess.free_port
      warn "#{server.name} (run #{run + 1}/#{@options[:runs]}) on 127.0.0.1:#{port}"
      process = server.start.call(port)
      begin
        process.wait_until_ready
        cells.each { |cell| measure_cell(cell, port, process, server.gc_socket&.call(port)) }
      rescue StandardError => e
        warn "  #{server.name} FAILED: #{e.message}"
        cells.each { |cell| cell[:failure] ||= e.message.lines.first.strip }
      ensure
        process.stop
      end
    end

    # One wrk run, with the server's CPU time (and allocations, when it
    # answers them on `gc_socket`) read right before and right after it.
    def measure_cell(cell, port, process, gc_socket)
      scenario = cell[:scenario]
      url = "http://127.0.0.1:#{port}#{scenario.path}"
      Wrk.run(url, connections: scenario.connections, duration: @options[:warmup]) if @options[:warmup].positive?
      cpu_before = ProcessCpu.session_seconds(process.pid)
      allocated_before = GcProbe.read(gc_socket) if gc_socket
      result = Wrk.run(url, connections: scenario.connections, duration: @options[:duration])
      cpu = ProcessCpu.session_seconds(process.pid) - cpu_before
      allocated = GcProbe.read(gc_socket) if gc_socket
      cell[:runs] << result
      requests = result.requests
      if requests.positive?
        cell[:cpu] << cpu * 1e6 / requests
        cell[:allocations] << (allocated - allocated_before).fdiv(requests) if allocated && allocated_before
      end
      warn format("  %-6s %9.0f req/s  p50 %s  p99 %s  %s us CPU/req%s%s", scenario.name, result.requests_per_second,
                  ms(result.p50), ms(result.p99), cell[:cpu].last&.round(1) || "-",
                  cell[:allocations].empty? ? "" : format("  %.1f allocations/req", cell[:allocations].last),
                  result.errors.positive? ? "  (#{result.error_text})" : "")
      warn "  (the server logged: #{process.log_tail(3).strip})" if result.errors.positive?
    end

    # The run with the median requests/s (the upper middle one for an even count).
    def median_run(cell)
      runs = cell[:runs].sort_by(&:requests_per_second)
      runs[runs.size / 2]
    end

    # The median requests/s of the cell's runs.
    def rate(cell)
      cell && !cell[:runs].empty? ? Samples.new(cell[:runs].map(&:requests_per_second)).median : nil
    end

    # The median CPU microseconds per request of the cell's runs.
    def cpu(cell)
      cell && Samples.new(cell[:cpu]).median
    end

    # The median allocations per request (nil for a server that does not tell).
    def allocations(cell)
      cell && Samples.new(cell[:allocations]).median
    end

    def find(results, server, scenario)
      results.find { |r| r[:server].name == server && r[:scenario].name == scenario }
    end

    # --- reporting --------------------------------------------------------------------

    def ms(seconds)
      seconds ? format("%.2f ms", seconds * 1000) : "-"
    end

    def report(results)
      puts "\nload average at end: #{Machine.load_average}"
      puts "\nServers:"
      ran = results.map { |result| result[:server] }.uniq
      ran.each { |server| puts "  #{server.name}: #{server.label}" }
      @scenarios.each { |scenario| report_scenario(scenario, results) }
      puts "\n#{targets_summary(results)}"
      FileUtils.mkdir_p(@options[:out])
      csv = write_csv(results)
      svg = write_svg(results)
      puts "\nwrote #{CommandLine.relative(csv)} and #{CommandLine.relative(svg)}"
    end

    def report_scenario(scenario, results)
      puts "\n#{scenario.title}: GET #{scenario.path}, #{scenario.connections} connections, #{@options[:duration]} s"
      table = Table.new(["server", "req/s", "p50", "p90", "p99", "errors", "CPU us/req", "allocs/req",
                         "NeverBlock req/s / this", "target", "met", "NeverBlock CPU / this", "target", "met"])
      nb = find(results, "neverblock", scenario.name)
      cells(results, scenario).each do |cell|
        run = cell[:runs].empty? ? nil : median_run(cell)
        name = cell[:server].name
        ratio = rate_ratio(nb, cell)
        cpu_ratio = cpu_ratio(nb, cell)
        target = scenario.targets[name]
        cpu_target = scenario.cpu_targets[name]
        table << [name, run ? format("%.0f", rate(cell)) : "FAILED", ms(run&.p50), ms(run&.p90), ms(run&.p99),
                  run ? cell[:runs].sum(&:errors) : "-", number(cpu(cell), 1), number(allocations(cell), 1),
                  ratio ? format("%.2fx", ratio) : "", target ? format(">= %.1fx", target) : "",
                  target ? met_text(ratio, target) : "",
                  cpu_ratio ? format("%.2fx", cpu_ratio) : "", cpu_target ? format("<= %.1fx", cpu_target) : "",
                  cpu_target ? met_text(cpu_ratio && 1 / cpu_ratio, 1 / cpu_target) : ""]
      end
      puts table
      if @options[:runs] > 1
        repeated = cells(results, scenario).select { |cell| cell[:runs].size > 1 }
        puts "runs (req/s): " + repeated.map { |r| "#{r[:server].name} #{Samples.new(r[:runs].map(&:requests_per_second)).to_s(digits: 0)}" }
                                        .join("; ")
        puts "runs (CPU us/req): " + repeated.map { |r| "#{r[:server].name} #{Samples.new(r[:cpu]).to_s(digits: 1)}" }.join("; ")
        with_allocations = repeated.reject { |r| r[:allocations].empty? }
        unless with_allocations.empty?
          puts "runs (allocations/req): " + with_allocations.map { |r| "#{r[:server].name} #{Samples.new(r[:allocations]).to_s(digits: 1)}" }
                                                            .join("; ")
        end
      end
      cells(results, scenario).each do |r|
        puts "#{r[:server].name} failed: #{r[:failure]}" if r[:failure]
        r[:runs].each_with_index do |run, i|
          puts "#{r[:server].name}, run #{i + 1}: #{run.error_text}" if run.errors.positive?
        end
      end
    end

    def cells(results, scenario)
      results.select { |r| r[:scenario].equal?(scenario) }
    end

    # NeverBlock's median req/s over the peer's (nil for NeverBlock itself).
    def rate_ratio(neverblock, cell)
      return nil if cell.equal?(neverblock)

      nb = rate(neverblock)
      peer = rate(cell)
      nb && peer ? nb / peer : nil
    end

    # NeverBlock's median CPU per request over the peer's (nil for NeverBlock itself).
    def cpu_ratio(neverblock, cell)
      return nil if cell.equal?(neverblock)

      nb = cpu(neverblock)
      peer = cpu(cell)
      nb && peer&.positive? ? nb / peer : nil
    end

    def number(value, digits)
      value ? format("%.#{digits}f", value) : "-"
    end

    def met_text(ratio, target)
      return "n/a" unless ratio

      ratio >= target ? "yes" : "no"
    end

    def targets_summary(results)
      lines = @scenarios.flat_map do |scenario|
        nb = find(results, "neverblock", scenario.name)
        by_rate = scenario.targets.filter_map do |peer, target|
          ratio = rate_ratio(nb, find(results, peer, scenario.name)) if nb
          next unless ratio

          "  #{scenario.name}: NeverBlock #{format('%.2fx', ratio)} #{peer}'s req/s (target >= #{target}x): #{met_text(ratio, target)}"
        end
        by_cpu = scenario.cpu_targets.filter_map do |peer, target|
          peer_cell = find(results, peer, scenario.name)
          ratio = cpu_ratio(nb, peer_cell) if nb && peer_cell
          next "  #{scenario.name}: CPU per request vs #{peer} (target <= #{target}x): n/a (not measured)" unless ratio

          format("  %s: NeverBlock's CPU per request %.1f us = %.2fx %s's %.1f us (target <= %sx): %s", scenario.name,
                 cpu(nb), ratio, peer, cpu(peer_cell), target, ratio <= target ? "met" : "not met")
        end
        by_rate + by_cpu
      end
      (["Targets:"] + (lines.empty? ? ["  (nothing to compare)"] : lines)).join("\n")
    end

    def write_csv(results)
      headers = %w[scenario server label path connections duration_s runs req_per_s req_per_s_runs p50_ms p90_ms p99_ms
                   errors cpu_us_per_req cpu_us_per_req_runs allocations_per_req allocations_per_req_runs
                   neverblock_ratio target met neverblock_cpu_ratio cpu_target cpu_met note]
      rows = results.map do |cell|
        run = cell[:runs].empty? ? nil : median_run(cell)
        scenario = cell[:scenario]
        name = cell[:server].name
        nb = find(results, "neverblock", scenario.name)
        ratio = rate_ratio(nb, cell)
        cpu_ratio = cpu_ratio(nb, cell)
        target = scenario.targets[name]
        cpu_target = scenario.cpu_targets[name]
        to_ms = ->(value) { value && (value * 1000).round(3) }
        [scenario.name, name, cell[:server].label, scenario.path, scenario.connections, @options[:duration], cell[:runs].size,
         rate(cell)&.round(1), cell[:runs].map { |r| r.requests_per_second.round }.join(" "),
         to_ms.call(run&.p50), to_ms.call(run&.p90), to_ms.call(run&.p99), run && cell[:runs].sum(&:errors),
         cpu(cell)&.round(2), cell[:cpu].map { |v| v.round(2) }.join(" "),
         allocations(cell)&.round(2), cell[:allocations].map { |v| v.round(2) }.join(" "),
         ratio&.round(3), target, target ? met_text(ratio, target) : nil,
         cpu_ratio&.round(3), cpu_target, cpu_target ? met_text(cpu_ratio && 1 / cpu_ratio, 1 / cpu_target) : nil,
         cell[:failure]]
      end
      CsvFile.write(File.join(@options[:out], "server.csv"), headers, rows)
    end

    def write_svg(results)
      chart = SvgChart.new(title: "NeverBlock::Server vs Puma, Falcon, Thin, iodine, agoo, nginx: one process each",
                           subtitle: ["ruby #{RUBY_VERSION}; #{@servers.map(&:label).map { |l| l.split(' (').first }.join(', ')}",
                                      "#{Machine.description}; wrk -t1 on the same machine#{@quick ? '; quick run' : ''}",
                                      "hello: #{@options[:connections]} connections; sleep and pg_sleep(0.01): " \
                                      "#{@options[:io_connections]} connections, db pool #{@options[:db_pool]}; " \
                                      "medians of #{@options[:runs]}"])
      names = @servers.map(&:name)
      value = ->(cell, &pick) { cell.nil? ? "n/a" : (cell[:runs].empty? ? "failed" : pick.call(cell)) }
      chart.add_panel(title: "requests/s (higher is better)",
                      categories: @scenarios.map { |s| "#{s.name} (#{s.connections} conn.)" },
                      series: names.to_h { |n| [n, @scenarios.map { |s| value.call(find(results, n, s.name)) { |cell| rate(cell) } }] },
                      log: true)
      chart.add_panel(title: "server CPU per request, us (lower is better)",
                      categories: @scenarios.map(&:name),
                      series: names.to_h { |n| [n, @scenarios.map { |s| value.call(find(results, n, s.name)) { |cell| cpu(cell)&.round(1) || "n/a" } }] },
                      log: true)
      chart.add_panel(title: "p99 latency, ms (lower is better)",
                      categories: @scenarios.map(&:name),
                      series: names.to_h do |n|
                        [n, @scenarios.map do |s|
                          value.call(find(results, n, s.name)) { |cell| median_run(cell).p99&.*(1000)&.round(2) }
                        end]
                      end,
                      log: true)
      chart.write(File.join(@options[:out], "server.svg"))
    end
  end
end

if $PROGRAM_NAME == __FILE__
  $stdout.sync = true
  require "neverblock"
  options = {}
  parser = OptionParser.new do |opts|
    opts.banner = "Usage: ruby bench/server.rb [options]"
    opts.on("--duration SECONDS", Integer, "measured seconds per cell (10)") { |value| options[:duration] = value }
    opts.on("--warmup SECONDS", Integer, "wrk warm-up seconds before each cell, 0 for none (2)") { |value| options[:warmup] = value }
    opts.on("--connections N", Integer, "keep-alive connections for hello (100)") { |value| options[:connections] = value }
    opts.on("--io-connections N", Integer, "connections for sleep and pg (256)") { |value| options[:io_connections] = value }
    opts.on("--db-pool N", Integer, "database connections of NeverBlock's and Falcon's pools (64)") { |value| options[:db_pool] = value }
    opts.on("--fiber-pool N", Integer, "NeverBlock::Server fiber_pool: requests at once (1000)") { |value| options[:fiber_pool] = value }
    opts.on("--runs N", Integer, "runs per cell; the median one is reported (1)") { |value| options[:runs] = value }
    opts.on("--scenarios LIST", Array, "hello,sleep,pg (all)") { |list| options[:scenarios] = list }
    opts.on("--quick", "smoke run: --duration 3 --warmup 1") { options[:quick] = true }
    NeverBlockBench::CommandLine.shared_options(opts, options, results: "server",
                                                               variants: "neverblock,puma,falcon,thin,iodine,agoo,nginx")
  end
  NeverBlockBench::CommandLine.run(parser) { NeverBlockBench::ServerBench.new(options).call }
end
