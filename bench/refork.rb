#!/usr/bin/env ruby
# frozen_string_literal: true

# Reforking's memory: a preforked worker that has warmed up is promoted to a
# "mold" and the next workers are forked from it, so that they share what the
# warm-up built. --workers workers serve each app,
#   rails  bench/rails/ (GET /fast: ActionController, an ActiveRecord query, render)
#   cache  support/refork_app.ru (each process builds a ~--cache-mb MiB cache of
#          Ruby hashes and strings on its first requests)
# under NeverBlock without reforking (neverblock: without --preload, the CLI's
# default; neverblock_preload), NeverBlock --refork-after without and with
# --preload, Pitchfork refork_after and Puma fork_worker (its first count), all
# going through the --refork-after schedule once (NeverBlock and Pitchfork get the
# same list, its last count not repeated). Each cell: a fresh server; --warmup
# requests from --connections keep-alive wrk connections (support/refork.lua); a
# wait until its processes stay the same and idle (the refork done); their PSS;
# --requests more requests measured, the same number for every server; PSS again
# ("PSS after": how far the generation drifted from its mold). PSS is the Pss line
# of /proc/PID/smaps_rollup (a page shared by n processes counts 1/n in each),
# summed over every process of the server's session (setsid): master, mold and
# workers; "workers" leaves out the master and mold. CPU: utime+stime of the
# session over the measured run (/proc). --smaps (the default) prints each
# process's memory by kind of mapping (support/smaps.rb) at both points.
#
#   bench/run --ruby 3.4-yjit refork           -> bench/results/ruby34-yjit/refork.{txt,csv,svg}
#   bench/run --ruby 3.4-yjit refork --quick   fewer warm-up and measured requests
#   bench/run --ruby 3.4-yjit refork --only rails --servers neverblock_refork,pitchfork --refork-after 50,100,1000
#   bench/run --ruby 3.4-yjit refork --only rails --servers neverblock_refork --server-env RUBY_GC_MALLOC_LIMIT=4000000

require_relative "support/harness"
require "neverblock/version"
require_relative "support/servers"
require_relative "support/postgres"
require_relative "support/smaps"

module NeverBlockBench
  class ReforkBench < Bench
    SERVERS = %w[neverblock neverblock_preload neverblock_refork neverblock_refork_preload pitchfork puma_fork_worker].freeze
    REFORKING = %w[neverblock_refork neverblock_refork_preload pitchfork puma_fork_worker].freeze
    DEFAULTS = { workers: 4, connections: 16, warmup: 4000, refork_after: [200], requests: 30_000, cache_mb: 100,
                 servers: SERVERS, smaps: true, server_env: "" }.freeze
    QUICK = { warmup: 1000, refork_after: [50], requests: 4000 }.freeze
    ONLY = %w[rails cache].freeze # the apps
    APPS = { "rails" => [File.expand_path("rails/config.ru", __dir__), "/fast"],
             "cache" => [File.expand_path("support/refork_app.ru", __dir__), "/"] }.freeze
    WARMUP_SCRIPT = File.expand_path("support/refork.lua", __dir__)
    # The next generation's limit, for NeverBlock and Pitchfork: one refork, as Puma's fork_worker does (a
    # refork_after list's last limit repeats; Pitchfork's `false` ends it, which NeverBlock may not take).
    NEVER = 1_000_000_000
    SETTLE_TIMEOUT = 60 # seconds a server may take to finish a refork
    URGE_AFTER = 5 # seconds after the warm-up without a refork
    # Puma reforks when its master sees worker 0's count, at a worker check: each second, not 5.
    PUMA_CONFIG = "fork_worker %d\nworker_check_interval 1\n"
    COLUMNS = ["app", "server", "replaced", "processes", "PSS MiB", "workers PSS MiB", "PSS after MiB", "req/s", "p50 ms", "p99 ms",
               "CPU s/1000 req", "lost", "note"].freeze

    # @return [Boolean] true when every NeverBlock cell that ran lost no request (peers' losses are reported, not failed)
    def call
      return warn(PostgresServer.problem) if @options[:only].include?("rails") && PostgresServer.problem

      unknown = @options[:servers] - SERVERS
      raise ArgumentError, "unknown server #{unknown.join(', ')}; use #{SERVERS.join(',')}" unless unknown.empty?

      puts header
      rows = @options[:only].product(SERVERS & @options[:servers]).map { |app, server| measure(app, server) }
      report(rows)
      rows.select { |row| row["server"].start_with?("neverblock") }
          .all? { |row| row["lost"].to_i.zero? && !row["note"].to_s.start_with?("FAILED") }
    end

    private

    def header
      v = PeerServers.locked_versions
      NeverBlockBench.header(
        "Reforking: the memory of #{@options[:workers]} warmed-up workers, reforked after #{@options[:refork_after].join(",")} requests of one",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}, -w #{@options[:workers]}); " \
        "pitchfork #{v['pitchfork']}; puma #{v['puma']} (fork_worker); rails #{v['railties']}; #{Wrk.version}",
        *("PostgreSQL: #{PostgresServer.description}" if @options[:only].include?("rails")),
        "each cell: a fresh server, #{@options[:warmup]} requests from #{@options[:connections]} keep-alive connections, " \
        "a wait until its processes stay the same and idle, PSS, #{@options[:requests]} requests of wrk -t1 measured, PSS after " \
        "(Pitchfork closes every connection: a connect per request)",
        "PSS: /proc/PID/smaps_rollup Pss summed over the server's session (master, mold, workers); workers: without master " \
        "and mold; replaced: workers not there before the warm-up; lost: wrk's socket errors and non-2xx over the whole cell"
      )
    end

    # One cell on a fresh server. @return [Hash] its row
    def measure(app, server)
      row = { "app" => app, "server" => server }
      row.merge!(run_cell(app, server))
      row
    rescue StandardError => e
      warn "  #{app}, #{server} FAILED: #{e.message}"
      row.merge!("note" => "FAILED: #{e.message.lines.first&.strip}")
    ensure
      warn "  #{app}, #{server}: #{row.except('app', 'server').map { |key, value| "#{key} #{value}" }.join(', ')}"
    end

    def run_cell(app, server)
      rackup, path = APPS.fetch(app)
      port = ServerProcess.free_port
      start(server, app, rackup, port).serve(path: "/ruby", timeout: 120) do |process|
        PeerServers.check_ruby(process)
        before = settle(process).filter_map { |p| p[:pid] if p[:role] == :worker }
        url = "http://127.0.0.1:#{port}#{path}"
        ENV["NB_REFORK_REQUESTS"] = @options[:warmup].to_s
        warmup = Wrk.run(url, connections: @options[:connections], duration: 600, timeout: 30, script: WARMUP_SCRIPT)
        # Puma's worker 0 may hold too few of the keep-alive connections to reach the count: then SIGURG.
        urged = nil
        urge = (-> { urged = Process.kill("URG", process.pid) } if server == "puma_fork_worker")
        after = settle(process, replacing: (before if REFORKING.include?(server)), urge: urge)
        puts Smaps.table("#{app}, #{server}", after) if @options[:smaps]
        ENV["NB_REFORK_REQUESTS"] = @options[:requests].to_s
        measured = Wrk.run(url, connections: @options[:connections], duration: 600, timeout: 30, script: WARMUP_SCRIPT, pid: process.pid)
        later = processes(process)
        puts Smaps.table("#{app}, #{server}, after the measured run", later) if @options[:smaps]
        numbers(after, before, warmup, measured)
          .merge("PSS after MiB" => (later.sum { |p| p[:pss] } / 1024.0).round(1))
          .tap { |row| row["note"] = ["reforked by SIGURG: worker 0 served too few", row["note"]].reject(&:empty?).join("; ") if urged }
      end
    end

    def numbers(after, before, warmup, measured)
      workers = after.select { |p| p[:role] == :worker }
      mib = ->(list) { (list.sum { |p| p[:pss] } / 1024.0).round(1) }
      { "replaced" => "#{workers.count { |p| !before.include?(p[:pid]) }} of #{workers.size}",
        "processes" => after.group_by { |p| p[:role] }.map { |role, list| "#{list.size} #{role}" }.join(", "),
        "PSS MiB" => mib.call(after), "workers PSS MiB" => mib.call(workers), "req/s" => measured.requests_per_second.round,
        "p50 ms" => (measured.p50 * 1000).round(2), "p99 ms" => (measured.p99 * 1000).round(2),
        "CPU s/1000 req" => (measured.cpu * 1000 / measured.requests).round(3), "lost" => warmup.errors + measured.errors,
        "note" => [warmup.error_text, measured.error_text].reject(&:empty?).join("; ") }
    end

    # Starts `server` serving `rackup` on `port`. @return [ServerProcess]
    def start(server, app, rackup, port)
      workers, refork_after = @options.values_at(:workers, :refork_after)
      env = { "NB_REFORK_CACHE_MB" => @options[:cache_mb].to_s, "NB_RAILS_ADAPTER" => "postgresql" }.merge(server_env)
      case server
      when /\Aneverblock/
        args = ["-w", workers.to_s, *("--preload" if server.end_with?("_preload")),
                *(["--refork-after", [*refork_after, NEVER].join(",")] if server.include?("refork"))]
        PeerServers.neverblock(rackup, port: port, args: args, name: "#{server}-#{app}",
                                       env: env.merge("NB_RAILS_ADAPTER" => "neverblock_postgresql", "NB_RAILS_POOL" => "50"))
      when "pitchfork"
        config = config_file("pitchfork.rb", "worker_processes #{workers}\nlisten \"127.0.0.1:#{port}\"\nrefork_after #{[*refork_after, NEVER]}\n")
        PeerServers.peer("pitchfork-#{app}", ["bundle", "exec", "pitchfork", "-c", config, "-E", "production", rackup], port,
                         env.merge("RACK_ENV" => "production", "NB_RAILS_POOL" => "1"))
      when "puma_fork_worker"
        PeerServers.puma(rackup, port: port, workers: workers, config: config_file("puma.rb", PUMA_CONFIG % refork_after.first),
                                 name: "puma-#{app}", env: env.merge("NB_RAILS_POOL" => "5"))
      end
    end

    # @return [Hash{String => String}] --server-env "NAME=value;NAME=value": more of every server's environment
    def server_env
      @options[:server_env].split(";").to_h { |pair| pair.split("=", 2) }
    end

    # Waits (at most SETTLE_TIMEOUT s) until the server has --workers workers, one of them
    # not among the pids `replacing` when given (a refork began; `urge` is called once when
    # none has after URGE_AFTER s), and, over three samples 0.5 s apart, the same processes
    # using under a tenth of a CPU. @return [Array<Hash>] its processes then ({#processes})
    def settle(server, replacing: nil, urge: nil)
      started = NeverBlockBench.now
      deadline = started + SETTLE_TIMEOUT
      cpu = ProcessCpu.session_seconds(server.pid)
      calm = 0
      seen = nil
      loop do
        sleep 0.5
        now = processes(server)
        used = ProcessCpu.session_seconds(server.pid) - cpu
        cpu += used
        same = now.map { |p| p[:pid] }.sort == seen&.map { |p| p[:pid] }&.sort
        workers = now.filter_map { |p| p[:pid] if p[:role] == :worker }
        reforked = replacing.nil? || !(workers - replacing).empty?
        calm = same && reforked && used < 0.05 && workers.size == @options[:workers] ? calm + 1 : 0
        seen = now
        return now if calm >= 3
        raise "no #{'refork and ' unless reforked}steady #{@options[:workers]} workers within #{SETTLE_TIMEOUT} s: " \
              "#{now.map { |p| p[:role] }.tally}\n#{server.log_tail}" if NeverBlockBench.now > deadline
        next unless urge && !reforked && NeverBlockBench.now > started + URGE_AFTER

        urge.call
        urge = nil
      end
    end

    # @return [Array<Hash>] :pid, :role (:master, :mold or :worker) and :pss (kB) of each live process of the session
    def processes(server)
      ProcessCpu.in_session(server.pid) do |dir, stat|
        next if stat[0] == "Z"

        pid = Integer(File.basename(dir))
        title = File.read("#{dir}/cmdline").tr("\0", " ")
        role = if pid == server.pid then :master elsif title.match?(/\bmold\b/) then :mold else :worker end
        { pid: pid, role: role, pss: File.read("#{dir}/smaps_rollup")[/^Pss:\s+(\d+) kB/, 1].to_i }
      end
    end

    def report(rows)
      puts "\n#{Table.of(rows, COLUMNS, left: %w[server processes note])}"
      chart = NeverBlockBench.chart("Reforking: PSS of #{@options[:workers]} warmed-up workers and their master and mold",
                                    "NeverBlock, NeverBlock --refork-after, Pitchfork refork_after, Puma fork_worker; " \
                                    "#{@options[:warmup]} warm-up requests, refork after #{@options[:refork_after].join(",")}")
      chart.pivot("total PSS after warm-up, MiB (lower is better)", "PSS MiB", by: "app", series: "server")
      chart.pivot("p99 latency after warm-up, ms (lower is better)", "p99 ms", by: "app", series: "server", log: true)
      NeverBlockBench.write_results(@options[:out], "refork", rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::ReforkBench, "refork") if $PROGRAM_NAME == __FILE__
