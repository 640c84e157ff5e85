#!/usr/bin/env ruby
# frozen_string_literal: true

# Keep-alive clients across workers: how evenly a multi-worker server shares
# connections that stay open. wrk (one thread, --timeout 10 s) holds
# --clients keep-alive connections and sends one request at a time on each;
# the worker that accepted a connection serves every request on it, so a
# worker that took more than its share keeps the extra load for the whole run.
#
#   NeverBlock  neverblock serve -w N (this checkout)
#   Puma        puma -w N --threads 5:5, its other settings default
#   Falcon      falcon serve --count N
#
# Endpoints (bench/support/keepalive_app.ru): /cpu computes for 20 ms of CPU;
# /mixed computes for 10 ms, then sleeps 10 ms (an IO wait). Every --endpoints
# x --clients x --workers x server is a cell; each run of a cell starts a
# fresh server, warms it up (--warmup seconds on connections of its own, then
# until it has finished what they asked), then runs wrk for --duration
# seconds. Runs are interleaved: run 1 of every cell, then run 2. Per cell the
# table shows the worst of --runs runs (highest p99):
#
#   requests, req/s  wrk's
#   p50/p99/max ms   each response's latency as the client timed it
#                    (bench/support/keepalive.lua), not wrk's distribution,
#                    which adds samples of its own for slow responses
#   over 2 s         responses slower than 2 s
#   errors           wrk's socket errors (timeouts too) and non-2xx responses
#   max/even         the busiest worker's responses over an even share (all
#                    responses / workers): 1.00 is even, N means one worker served all
#   per worker       each worker's responses (x-pid), most first
#   CPU ms/req       the server's CPU time (user + system, all its processes,
#                    from /proc) during the run, per response; it includes the
#                    work on requests still unanswered when wrk stops (up to
#                    one per client), so short runs with many clients read high
#
# and the median p99 and max/even over the runs.
#
#   bench/run keepalive                   -> bench/results/keepalive.{txt,csv,svg}
#   bench/run keepalive --quick           4 s cells, one run
#   bench/run --ruby 3.4-yjit keepalive   -> bench/results/ruby34-yjit/
#   bench/run keepalive --only neverblock,puma --endpoints cpu --clients 100 --workers 4

require_relative "support/harness"
require "neverblock/version"
require_relative "support/servers"

module NeverBlockBench
  # Runs the keep-alive fairness benchmark and reports it. See the file comment.
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
    LEFT = ["endpoint", "server", "per worker", "note"].freeze # the table's left-aligned columns

    Cell = Struct.new(:endpoint, :clients, :workers, :server) do
      def to_s = "/#{endpoint}, #{clients} clients, #{workers} workers, #{server}"
    end

    # @return [Boolean] true when every run of every cell succeeded
    def call
      endpoints = CommandLine.only(@options[:endpoints], ENDPOINTS)
      cells = endpoints.product(@options[:clients], @options[:workers], @options[:only]).map { |values| Cell.new(*values) }
      runs = cells.to_h { |cell| [cell, []] }
      puts header
      @options[:runs].times do |round|
        cells.each do |cell|
          runs[cell] << (run = measure(cell))
          warn "  #{cell}, run #{round + 1}: " + (run[:failure] || format("p99 %.1f ms, max/even %.2f, %.0f req/s, per worker %s",
                                                                         run[:p99], run[:max_even], run[:rps], run[:counts].join(" ")))
        end
      end
      report(cells.map { |cell| row(cell, runs[cell]) }, endpoints)
      runs.values.flatten.none? { |run| run[:failure] }
    ensure
      ServerProcess.stop_all
    end

    private

    def header
      v = PeerServers.locked_versions
      NeverBlockBench.header(
        "Keep-alive clients across workers: #{@options[:clients].join(', ')} connections, #{@options[:workers].join(', ')} workers",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); puma #{v['puma']} (--threads #{PUMA_THREADS}); " \
        "falcon #{v['falcon']} (async #{v['async']}); #{Wrk.version}",
        "each run: a fresh server, #{@options[:warmup]} s warm-up (then until the server is idle), " \
        "#{@options[:duration]} s of wrk -t1 --timeout 10s; " \
        "latencies as the client timed each response",
        "wrk and the servers on the same machine"
      )
    end

    # One run of `cell` on a fresh server.
    # @return [Hash] the run's numbers, or :failure (text)
    def measure(cell)
      PeerServers.cluster(cell.server, APP, workers: cell.workers, puma_threads: PUMA_THREADS) do |server|
        PeerServers.check_ruby(server)
        url = "http://127.0.0.1:#{server.port}/#{cell.endpoint}"
        Wrk.run(url, connections: cell.clients, duration: @options[:warmup]) if @options[:warmup].positive?
        cpu = idle_cpu(server)
        result = Wrk.run(url, connections: cell.clients, duration: @options[:duration], script: SCRIPT)
        cpu = ProcessCpu.session_seconds(server.pid) - cpu
        parse(result, cell.workers).merge(cpu_ms: (cpu * 1000 / result.requests if result.requests.positive?))
      end
    rescue StandardError => e
      { failure: "#{e.class}: #{e.message.lines.first&.strip}" }
    end

    # Waits until the server's processes use under 10% of a CPU (at most
    # SETTLE_TIMEOUT seconds): a server may go on computing what the warm-up's
    # clients asked for after they left, which would fall into the measured run.
    # @return [Float] the server's CPU seconds so far
    def idle_cpu(server)
      deadline = NeverBlockBench.now + SETTLE_TIMEOUT
      cpu = ProcessCpu.session_seconds(server.pid)
      loop do
        sleep 0.3
        before = cpu
        cpu = ProcessCpu.session_seconds(server.pid)
        return cpu if cpu - before < 0.03 || NeverBlockBench.now > deadline
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
        max_even: counts.sum.positive? ? counts.max * workers / counts.sum.to_f : 0.0, wrk_p99: result.p99 && result.p99 * 1000 }
    end

    # A cell's CSV row: its worst run (highest p99, then highest max), the
    # median p99 and max/even over its runs, and its failures.
    def row(cell, runs)
      done = runs.reject { |run| run[:failure] }
      worst = done.max_by { |run| [run[:p99], run[:max]] } || {}
      median = ->(key) { NeverBlockBench.median(done.map { |run| run[key] }) }
      two = ->(value) { format("%.2f", value) if value }
      failures = runs.filter_map { |run| run[:failure] }
      { "endpoint" => cell.endpoint, "clients" => cell.clients, "workers" => cell.workers, "server" => cell.server,
        "requests" => worst[:requests], "req/s" => worst[:rps]&.round, "p50 ms" => worst[:p50]&.round(1),
        "p99 ms" => worst[:p99]&.round(1), "max ms" => worst[:max]&.round(1), "over 2 s" => worst[:over_2s],
        "errors" => worst[:errors], "max/even" => two.call(worst[:max_even]), "per worker" => worst[:counts]&.join(" "),
        "CPU ms/req" => two.call(worst[:cpu_ms]), "median p99 ms" => median.call(:p99)&.round(1), "median max/even" => two.call(median.call(:max_even)),
        "runs" => done.size, "wrk p99 ms" => worst[:wrk_p99]&.round(1), "cell" => "#{cell.clients} clients, #{cell.workers} workers",
        "note" => ("#{failures.size} of #{runs.size} runs failed: #{failures.first}" unless failures.empty?) }
    end

    def report(rows, endpoints)
      table = Table.new(COLUMNS, rows.map { |row| row.values_at(*COLUMNS) }, align: COLUMNS.map { |name| LEFT.include?(name) ? :left : :right })
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
