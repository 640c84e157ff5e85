#!/usr/bin/env ruby
# frozen_string_literal: true

# Keep-alive clients across workers: how evenly NeverBlock (`-w N`), Puma
# (`-w N --threads 5:5`) and Falcon (`--count N`) share --clients connections
# that wrk (one thread, --timeout 10 s) keeps open, on /cpu (20 ms of CPU)
# and /mixed (10 ms of CPU, then 10 ms asleep) of support/keepalive_app.ru.
# Each run: a fresh server, --warmup s of wrk, a wait until it is idle,
# --duration s of wrk. Per cell the worst of --runs runs (highest p99):
# latencies as the client timed each response (support/keepalive.lua),
# max/even (the busiest worker's responses over an even share: 1.00 is
# even), each worker's responses, the server's CPU per response; and the
# medians of p99 and max/even over the runs.
#
#   bench/run keepalive                   -> bench/results/keepalive.{txt,csv,svg}
#   bench/run keepalive --quick           4 s cells, one run
#   bench/run --ruby 3.4-yjit keepalive   -> bench/results/ruby34-yjit/
#   bench/run keepalive --only neverblock,puma --endpoints cpu --clients 100 --workers 4

require_relative "support/harness"
require "neverblock/version"
require_relative "support/servers"

module NeverBlockBench
  class KeepaliveBench < Bench
    APP = File.expand_path("support/keepalive_app.ru", __dir__)
    SCRIPT = File.expand_path("support/keepalive.lua", __dir__)
    DEFAULTS = { duration: 10, warmup: 2, runs: 3, clients: [10, 100], workers: [2, 4], endpoints: %w[cpu mixed] }.freeze
    QUICK = { duration: 4, warmup: 1, runs: 1 }.freeze
    ONLY = %w[neverblock puma falcon].freeze # the servers
    ENDPOINTS = %w[cpu mixed].freeze
    PUMA_THREADS = "5:5"
    SETTLE_TIMEOUT = 30 # seconds a server may take to finish the warm-up's requests
    COLUMNS = ["endpoint", "clients", "workers", "server", "requests", "req/s", "p50 ms", "p99 ms", "max ms", "over 2 s",
               "errors", "max/even", "per worker", "CPU ms/req", "median p99 ms", "median max/even", "note"].freeze

    Cell = Struct.new(:endpoint, :clients, :workers, :server, :runs) do
      def to_s = "/#{endpoint}, #{clients} clients, #{workers} workers, #{server}"
    end

    # @return [Boolean] true when every run of every cell succeeded
    def call
      endpoints = CommandLine.only(@options[:endpoints], ENDPOINTS)
      cells = endpoints.product(@options[:clients], @options[:workers], @options[:only]).map { |values| Cell.new(*values, []) }
      puts header
      @options[:runs].times do |round|
        cells.each do |cell|
          cell.runs << (run = measure(cell))
          warn "  #{cell}, run #{round + 1}: " + (run[:failure] || format("p99 %.1f ms, max/even %.2f, %.0f req/s, per worker %s",
                                                                         run[:p99], run[:max_even], run[:rps], run[:counts].join(" ")))
        end
      end
      report(cells.map { |cell| row(cell) }, endpoints)
      cells.flat_map(&:runs).none? { |run| run[:failure] }
    end

    private

    def header
      v = PeerServers.locked_versions
      NeverBlockBench.header(
        "Keep-alive clients across workers: #{@options[:clients].join(', ')} connections, #{@options[:workers].join(', ')} workers",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); puma #{v['puma']} (--threads #{PUMA_THREADS}); " \
        "falcon #{v['falcon']} (async #{v['async']}); #{Wrk.version}",
        "each run: a fresh server, #{@options[:warmup]} s warm-up (then until the server is idle), " \
        "#{@options[:duration]} s of wrk -t1 --timeout 10s; latencies as the client timed each response",
        "wrk and the servers on the same machine"
      )
    end

    # One run of `cell` on a fresh server. @return [Hash] the run's numbers, or :failure (text)
    def measure(cell)
      PeerServers.cluster(cell.server, APP, workers: cell.workers, puma_threads: PUMA_THREADS) do |server|
        PeerServers.check_ruby(server)
        url = "http://127.0.0.1:#{server.port}/#{cell.endpoint}"
        Wrk.run(url, connections: cell.clients, duration: @options[:warmup]) if @options[:warmup].positive?
        settle(server)
        parse(Wrk.run(url, connections: cell.clients, duration: @options[:duration], script: SCRIPT, pid: server.pid), cell.workers)
      end
    rescue StandardError => e
      { failure: "#{e.class}: #{e.message.lines.first&.strip}" }
    end

    # Waits (at most SETTLE_TIMEOUT seconds) until the server uses under 10% of
    # a CPU: it may go on computing what the warm-up's clients asked for.
    def settle(server)
      deadline = NeverBlockBench.now + SETTLE_TIMEOUT
      cpu = ProcessCpu.session_seconds(server.pid)
      until NeverBlockBench.now > deadline
        sleep 0.3
        cpu, before = ProcessCpu.session_seconds(server.pid), cpu # rubocop:disable Style/ParallelAssignment
        return if cpu - before < 0.03
      end
    end

    # The numbers of one wrk run, with what bench/support/keepalive.lua printed.
    def parse(result, workers)
      text = result.output
      latency = text[/^keepalive latency_us (\d+ \d+ \d+)$/, 1] or raise "no keepalive lines in wrk's output:\n#{text}"
      p50, p99, max = latency.split.map { |us| Integer(us) / 1000.0 }
      counts = text.scan(/^keepalive pid \S+ (\d+)$/).map { |(count)| Integer(count) }.sort.reverse
      counts.fill(0, counts.size...workers) # the workers that answered none
      { requests: result.requests, rps: result.requests_per_second, p50: p50, p99: p99, max: max,
        over_2s: Integer(text[/^keepalive over_2s (\d+)$/, 1]), errors: result.errors, counts: counts,
        max_even: counts.sum.positive? ? counts.max * workers / counts.sum.to_f : 0.0, wrk_p99: result.p99 && result.p99 * 1000,
        cpu_ms: (result.cpu * 1000 / result.requests if result.requests.positive?) }
    end

    # A cell's CSV row: its worst run (highest p99, then highest max), the
    # median p99 and max/even over its runs, and its failures.
    def row(cell)
      done = cell.runs.reject { |run| run[:failure] }
      worst = done.max_by { |run| [run[:p99], run[:max]] } || {}
      median = ->(key) { NeverBlockBench.median_of(done, key) }
      two = ->(value) { format("%.2f", value) if value }
      failures = cell.runs.filter_map { |run| run[:failure] }
      { "endpoint" => cell.endpoint, "clients" => cell.clients, "workers" => cell.workers, "server" => cell.server,
        "requests" => worst[:requests], "req/s" => worst[:rps]&.round, "p50 ms" => worst[:p50]&.round(1),
        "p99 ms" => worst[:p99]&.round(1), "max ms" => worst[:max]&.round(1), "over 2 s" => worst[:over_2s],
        "errors" => worst[:errors], "max/even" => two.call(worst[:max_even]), "per worker" => worst[:counts]&.join(" "),
        "CPU ms/req" => two.call(worst[:cpu_ms]), "median p99 ms" => median.call(:p99)&.round(1), "median max/even" => two.call(median.call(:max_even)),
        "runs" => done.size, "wrk p99 ms" => worst[:wrk_p99]&.round(1), "cell" => "#{cell.clients} clients, #{cell.workers} workers",
        "note" => ("#{failures.size} of #{cell.runs.size} runs failed: #{failures.first}" unless failures.empty?) }
    end

    def report(rows, endpoints)
      table = Table.of(rows, COLUMNS, left: ["server", "per worker", "note"])
      puts "\nthe worst of #{@options[:runs]} runs per cell (highest p99), and the medians over the runs\n\n#{table}"
      chart = NeverBlockBench.chart("Keep-alive clients across workers: p99 of the worst of #{@options[:runs]} runs",
                                    "NeverBlock -w N, Puma -w N --threads #{PUMA_THREADS}, Falcon --count N")
      endpoints.each do |endpoint|
        chart.pivot("/#{endpoint}: p99, ms (lower is better)", "p99 ms", by: "cell", series: "server", where: { "endpoint" => endpoint }, log: true)
      end
      NeverBlockBench.write_results(@options[:out], "keepalive", rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::KeepaliveBench, "keepalive") if $PROGRAM_NAME == __FILE__
