#!/usr/bin/env ruby
# frozen_string_literal: true

# NeverBlock::Server against Puma (also in its IO mode), Falcon, Thin, iodine
# and agoo (nginx as the hardware reference), one serving process each, loaded
# by Debian's wrk (`-t1 -cN -dXs --latency`, keep-alive): req/s, latency, the
# server's CPU per request (its session, from /proc) and NeverBlock's
# allocations per request. Scenarios (support/server_app.rb): hello (GET /,
# --connections, every server), hello_close (the same, each request on a
# connection of its own, `Connection: close`, 20 at once: what a server does
# per connection; not run unless named), sleep (`sleep 0.01`) and pg (`select
# pg_sleep(0.01)` through a pool of --db-pool) at --io-connections. puma_io is
# Puma 8's IO mode (support/puma_io.rb: 0:5 threads + --puma-io-threads for
# requests marked IO-bound); Puma 8.0.2's IO mode stays at 5 threads after its
# first lull (puma#3958), so puma_threads has 0:(5 + --puma-io-threads). The
# "met" columns check each Scenario's targets. Servers start once per round
# and are warmed up per scenario; --runs rounds interleave, each number is a
# median (latencies: the run with the median req/s). pg needs PostgreSQL.
#
#   bench/run server --runs 3           -> bench/results/server.{txt,csv,svg} (Ruby 3.1)
#   bench/run --ruby 3.4-yjit server    -> bench/results/ruby34-yjit/: every server on Ruby 3.4, YJIT on
#   bench/run server --quick            smoke run: 3 s per cell, 1 s warm-up
#   bench/run server --only neverblock,puma --scenarios hello
#   bench/run --ruby 3.4-yjit server --only neverblock,puma,falcon,iodine --scenarios hello_close --runs 3
#   bench/run --ruby 3.4-yjit server --only neverblock,before,iodine --before REV --scenarios hello --runs 5
#
# --before REV adds "before": NeverBlock at REV (a git worktree, its own C
# extension), run as "neverblock" is, for a before/after row in one run.

require_relative "support/harness"
require "neverblock"
require_relative "support/servers"
require_relative "support/server_app"
require_relative "support/worktrees"

module NeverBlockBench
  class ServerBench < Bench
    include Worktrees

    DEFAULTS = { duration: 10, warmup: 2, connections: 100, io_connections: 256, puma_io_threads: 256, db_pool: 64, fiber_pool: 1000, runs: 1,
                 scenarios: %w[hello sleep pg], before: "" }.freeze
    QUICK = { duration: 3, warmup: 1 }.freeze
    ONLY = %w[neverblock before puma puma_io puma_threads falcon thin iodine agoo nginx].freeze # the servers
    APP = File.expand_path("support/server_app.ru", __dir__)
    PUMA_IO_CONFIG = File.expand_path("support/puma_io.rb", __dir__)
    PUMA_THREADS = 5 # Puma 8's default maximum on MRI (0:5)
    CLOSE_CONNECTIONS = 20 # hello_close: few, as each opens a socket per request (TIME_WAIT)
    # `targets`: peer => the req/s ratio NeverBlock should reach; `cpu_targets`: the CPU ratio it should stay under.
    Scenario = Struct.new(:name, :path, :title, :connections, :targets, :cpu_targets, :database, :headers, keyword_init: true)
    # `start` takes a port and returns a ServerProcess; `gc_socket`, given a port, where NeverBlock answers its allocations.
    Server = Struct.new(:name, :label, :start, :scenarios, :gc_socket, keyword_init: true)
    # The columns of each scenario's printed table (all are in the CSV).
    TABLE = %w[server req_per_s p50_ms p90_ms p99_ms errors cpu_us_per_req allocations_per_req neverblock_ratio target met
               neverblock_cpu_ratio cpu_target cpu_met].freeze

    def initialize(options)
      super
      @scenarios = scenarios.select { |scenario| @options[:scenarios].include?(scenario.name) }
      @servers = servers.select { |server| @options[:only].include?(server.name) }
    end

    # @return [Boolean] true when every server started and NeverBlock answered every request
    def call
      Machine.raise_fd_limit(8192)
      @selector = Peers.use_epoll
      return false unless ready?

      puts header
      cells = @servers.to_h do |server|
        mine = @scenarios.select { |scenario| server.scenarios.include?(scenario.name) }
        [server, mine.map { |scenario| Cell.new("#{server.name} #{scenario.name}", server: server, scenario: scenario) }]
      end
      @options[:runs].times { |round| cells.each { |server, mine| measure_server(server, mine, round) unless mine.empty? } }
      report(cells = cells.values.flatten)
      cells.all? { |cell| cell.failures.empty? && (cell[:server].name != "neverblock" || cell.runs.all? { |run| run.errors.zero? }) }
    end

    private

    def scenarios
      [Scenario.new(name: "hello", path: "/", title: "Hello world, keep-alive", connections: @options[:connections],
                    targets: { "puma" => 1.2, "falcon" => 2.0, "thin" => 1.0 }, cpu_targets: { "puma" => 0.5, "iodine" => 1.5 }),
       # As a proxy that opens a connection per request sends them (nginx's
       # default to its upstreams, HTTP/1.0): the server's per-connection work.
       Scenario.new(name: "hello_close", path: "/", title: "Hello world, a connection per request (Connection: close)",
                    connections: CLOSE_CONNECTIONS, targets: {}, cpu_targets: {}, headers: ["Connection: close"]),
       Scenario.new(name: "sleep", path: "/sleep", title: "IO-bound: sleep 0.01", connections: @options[:io_connections],
                    targets: { "puma" => 10.0, "falcon" => 1.2 }, cpu_targets: {}),
       Scenario.new(name: "pg", path: "/pg", title: "IO-bound: select pg_sleep(0.01) through a pool", connections: @options[:io_connections],
                    targets: { "puma" => 10.0, "falcon" => 1.2, "puma_io" => 3.0, "puma_threads" => 3.0 },
                    cpu_targets: { "puma_io" => 1.0, "puma_threads" => 1.0 }, database: true)]
    end

    def servers
      pool = @options[:db_pool]
      all = %w[hello hello_close sleep pg]
      io_threads = @options[:puma_io_threads]
      v = PeerServers.locked_versions
      gc_socket = ->(port) { File.join(scratch, "neverblock-#{port}-gc.sock") }
      db = ->(kind, extra = {}) { { "NB_BENCH_DB" => kind, "NB_BENCH_DB_POOL" => pool.to_s }.merge(extra) }
      peer = ->(name, port, *command, env: {}) { PeerServers.peer(name, ["bundle", "exec", name, *command], port, env) }
      neverblock = lambda do |port, dir: nil|
        env = db.call("neverblock", "NB_BENCH_GC_SOCKET" => gc_socket.call(port)).merge(dir ? revision_env(dir) : {})
        PeerServers.neverblock(APP, port: port, args: ["-w", "0", "--fiber-pool", @options[:fiber_pool].to_s], env: env,
                                    repo: dir || PeerServers::REPO)
      end
      [Server.new(name: "neverblock", scenarios: all, gc_socket: gc_socket, start: neverblock,
                  label: "NeverBlock #{NeverBlock::VERSION} (1 process, fiber_pool #{@options[:fiber_pool]}; pg: NeverBlock::Postgres.pool(size: #{pool}))"),
       *(unless @options[:before].empty?
           [Server.new(name: "before", scenarios: all, gc_socket: gc_socket,
                       label: "NeverBlock at #{@options[:before]} (as neverblock)",
                       start: ->(port) { neverblock.call(port, dir: (@before_dir ||= checkout(@options[:before]))) })]
         end),
       Server.new(name: "puma", label: "Puma #{v['puma']} (single mode, default threads 0:5; pg: a connection per thread)", scenarios: all,
                  start: ->(port) { PeerServers.puma(APP, port: port, env: db.call("threads")) }),
       # Puma 8's IO mode: up to 5 threads plus io_threads more for requests marked IO-bound, a pg connection each.
       Server.new(name: "puma_io", scenarios: %w[sleep pg],
                  label: "Puma #{v['puma']} IO mode (single mode, threads 0:#{PUMA_THREADS} + max_io_threads #{io_threads}; " \
                         "pg: a connection per thread, up to #{PUMA_THREADS + io_threads})",
                  start: lambda do |port|
                    PeerServers.puma(APP, port: port, config: PUMA_IO_CONFIG, name: "puma_io",
                                          env: db.call("threads", "NB_BENCH_PUMA_IO_THREADS" => io_threads.to_s))
                  end),
       # As many threads as IO mode allows at most, without its accounting bug (see the file comment).
       Server.new(name: "puma_threads", scenarios: %w[sleep pg],
                  label: "Puma #{v['puma']} (single mode, threads 0:#{PUMA_THREADS + io_threads}; pg: a connection per thread)",
                  start: lambda do |port|
                    PeerServers.puma(APP, port: port, threads: "0:#{PUMA_THREADS + io_threads}", name: "puma_threads", env: db.call("threads"))
                  end),
       # Falcon with one forked server process (its supervisor is the other), HTTP/1.1.
       Server.new(name: "falcon", label: "Falcon #{v['falcon']} (async #{v['async']}, --count 1; pg: fair fiber pool of #{pool})", scenarios: all,
                  start: ->(port) { peer.call("falcon", port, *%W[serve --bind http://127.0.0.1:#{port} --count 1 --config #{APP}], env: db.call("fibers")) }),
       Server.new(name: "thin", label: "Thin #{v['thin']} (eventmachine #{v['eventmachine']})", scenarios: %w[hello],
                  start: ->(port) { peer.call("thin", port, *%W[start --address 127.0.0.1 --port #{port} --rackup #{APP} --environment production --quiet]) }),
       # iodine (C): one worker, one thread for the app.
       Server.new(name: "iodine", label: "iodine #{v['iodine']} (-w 1 -t 1)", scenarios: %w[hello hello_close],
                  start: ->(port) { peer.call("iodine", port, *%W[-b 127.0.0.1 -p #{port} -w 1 -t 1 #{APP}]) }),
       # agoo (C): one worker; the app on the thread that started it, HTTP on agoo's C threads.
       Server.new(name: "agoo", label: "agoo #{v['agoo']} (-w 1, the app on one thread)", scenarios: %w[hello],
                  start: ->(port) { peer.call("agoo", port, *%W[-p #{port} -w 1 #{APP}]) }),
       Server.new(name: "nginx", label: "#{PeerServers.nginx_version} (1 worker, no master; return 200)", scenarios: %w[hello],
                  start: ->(port) { PeerServers.nginx(port: port, dir: scratch) })]
    end

    # @return [Boolean] false (after a warning) when nothing can be measured
    def ready?
      return warn("wrk is not installed; run bin/setup") && false unless Wrk.version
      if @scenarios.any?(&:database) && PostgresServer.problem
        warn "skipping the pg scenario: #{PostgresServer.problem}"
        @scenarios = @scenarios.reject(&:database)
      end
      true
    end

    def header
      v = PeerServers.locked_versions
      runs = @options[:runs] == 1 ? "one run per cell" : "#{@options[:runs]} interleaved rounds; medians per cell (latencies: the run with the median req/s)"
      NeverBlockBench.header(
        "NeverBlock::Server benchmark: one serving process per server, same machine, same run",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}), io-event #{Machine.gem_version('io-event')}, " \
        "llhttp #{Machine.gem_version('llhttp')}; peers: puma #{v['puma']}, falcon #{v['falcon']} (async #{v['async']}, " \
        "io-event #{v['io-event']}), thin #{v['thin']}, iodine #{v['iodine']}, agoo #{v['agoo']}, rack #{v['rack']}; " \
        "#{PeerServers.nginx_version}; #{Wrk.version}",
        "io-event selector for NeverBlock and Falcon: #{@selector} (IO_EVENT_SELECTOR, NEVERBLOCK_SELECTOR)",
        *("PostgreSQL: #{PostgresServer.description}; #{PostgresServer.driver_description}" if @scenarios.any?(&:database)),
        "wrk -t1 -c<connections> -d#{@options[:duration]}s --latency after a #{@options[:warmup]} s warm-up; #{runs}",
        "CPU us/request: user+system time of the server's process session over the measured run / requests (from /proc)",
        "wrk and the servers share the machine (wrk takes about one CPU): treat req/s differences under ~20 % as noise;",
        "CPU per request moves less (it counts only the server's own time)."
      )
    end

    # Starts the server once for all its scenarios in this round; per cell a
    # warm-up, then one wrk run with the server's CPU time (and allocations)
    # read right before and after it. A cell's runs are Wrk::Results.
    def measure_server(server, cells, round)
      port = ServerProcess.free_port
      warn "#{server.name} (run #{round + 1}/#{@options[:runs]}) on 127.0.0.1:#{port}"
      server.start.call(port).serve do |process|
        warn "  #{PeerServers.check_ruby(process)}" unless server.name == "nginx"
        gc_socket = server.gc_socket&.call(port)
        cells.each do |cell|
          url = "http://127.0.0.1:#{port}#{cell[:scenario].path}"
          Wrk.run(url, connections: cell[:scenario].connections, duration: @options[:warmup], headers: cell[:scenario].headers || []) if @options[:warmup].positive?
          allocated_before = gc_socket && GcProbe.read(gc_socket)
          result = Wrk.run(url, connections: cell[:scenario].connections, duration: @options[:duration], pid: process.pid,
                           headers: cell[:scenario].headers || [])
          cell.runs << result
          allocated = gc_socket && GcProbe.read(gc_socket)
          cell.cpu << result.cpu * 1e6 / result.requests if result.requests.positive?
          cell.allocations << (allocated - allocated_before).fdiv(result.requests) if allocated && allocated_before && result.requests.positive?
          warn "  #{cell[:scenario].name}: #{result.requests_per_second.round} req/s, #{cell.cpu.last&.round(1)} us CPU/req #{result.error_text}"
          warn "  (the server logged: #{process.log_tail(3).strip})" if result.errors.positive?
        end
      end
    rescue StandardError => e
      warn "  #{server.name} FAILED: #{e.message}"
      cells.each { |cell| cell.failures << e.message.lines.first.strip if cell.failures.empty? }
    end

    # The run with the median req/s (the upper middle one for an even count).
    def median_run(cell) = cell.runs.sort_by(&:requests_per_second)[cell.runs.size / 2]
    def rate(cell) = NeverBlockBench.median(cell.runs.map(&:requests_per_second))
    def cpu(cell) = NeverBlockBench.median(cell.cpu)
    def met_text(ratio, target) = ratio ? (ratio >= target ? "yes" : "no") : "n/a"

    # NeverBlock's median over the peer's: req/s (`of` :rate) or CPU per request (:cpu); nil for NeverBlock itself.
    def ratio(nb, cell, of)
      return nil if cell.equal?(nb) || nb.nil?

      mine, theirs = send(of, nb), send(of, cell) # rubocop:disable Style/ParallelAssignment
      mine && theirs&.positive? ? mine / theirs : nil
    end

    def report(cells)
      puts "\nServers:"
      cells.map { |cell| cell[:server] }.uniq.each { |server| puts "  #{server.name}: #{server.label}" }
      rows = cells.map { |cell| csv_row(cells, cell) }
      @scenarios.each do |scenario|
        puts "\n#{scenario.title}: GET #{scenario.path}, #{scenario.connections} connections, #{@options[:duration]} s"
        puts Table.of(mine = rows.select { |row| row["scenario"] == scenario.name }, TABLE)
        mine.each do |row|
          puts "#{row['server']} runs: req/s #{row['req_per_s_runs']}; CPU us/req #{row['cpu_us_per_req_runs']}" if @options[:runs] > 1
          puts "#{row['server']}: #{row['note']}" if row["note"]
        end
      end
      chart = NeverBlockBench.chart("NeverBlock::Server vs Puma (and its IO mode), Falcon, Thin, iodine, agoo, nginx: one process each",
                                    @servers.map { |s| s.label.split(" (").first }.join(", "),
                                    "hello: #{@options[:connections]} connections; sleep and pg_sleep(0.01): #{@options[:io_connections]} " \
                                    "connections, db pool #{@options[:db_pool]}; medians of #{@options[:runs]}; wrk -t1 on the same machine")
      %w[req_per_s cpu_us_per_req p99_ms].each { |value| chart.pivot("#{value} by scenario", value, by: "scenario", series: "server", log: true) }
      NeverBlockBench.write_results(@options[:out], "server", rows, chart)
    end

    # A cell's medians (latencies: of the run with the median req/s), every run, and NeverBlock's ratios to it.
    def csv_row(cells, cell)
      run = median_run(cell) unless cell.runs.empty?
      scenario = cell[:scenario]
      nb = cells.find { |c| c[:server].name == "neverblock" && c[:scenario].equal?(scenario) }
      r, cpu_r = ratio(nb, cell, :rate), ratio(nb, cell, :cpu) # rubocop:disable Style/ParallelAssignment
      target, cpu_target = [scenario.targets, scenario.cpu_targets].map { |targets| targets[cell[:server].name] }
      to_ms = ->(seconds) { seconds && (seconds * 1000).round(2) }
      runs = ->(values) { values.map { |x| x.round(1) }.join(" ") }
      { "scenario" => scenario.name, "server" => cell[:server].name, "label" => cell[:server].label, "path" => scenario.path,
        "connections" => scenario.connections, "duration_s" => @options[:duration], "runs" => cell.runs.size,
        "req_per_s" => rate(cell)&.round, "req_per_s_runs" => cell.runs.map { |x| x.requests_per_second.round }.join(" "),
        "p50_ms" => to_ms.call(run&.p50), "p90_ms" => to_ms.call(run&.p90), "p99_ms" => to_ms.call(run&.p99),
        "errors" => run && cell.runs.sum(&:errors), "cpu_us_per_req" => cpu(cell)&.round(1),
        "cpu_us_per_req_runs" => runs.call(cell.cpu), "allocations_per_req" => NeverBlockBench.median(cell.allocations)&.round(1),
        "allocations_per_req_runs" => runs.call(cell.allocations),
        "neverblock_ratio" => r&.round(2), "target" => target, "met" => (met_text(r, target) if target),
        "neverblock_cpu_ratio" => cpu_r&.round(2), "cpu_target" => cpu_target,
        "cpu_met" => (met_text(cpu_r && 1 / cpu_r, 1 / cpu_target) if cpu_target),
        "note" => cell.failures.first || cell.runs.select { |each| each.errors.positive? }.map(&:error_text).first }
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::ServerBench, "server") if $PROGRAM_NAME == __FILE__
