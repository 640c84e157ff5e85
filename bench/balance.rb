#!/usr/bin/env ruby
# frozen_string_literal: true

# Balancing across workers (issue 20, item 4): four workers each, fast
# requests measured by wrk (GET /, keep-alive, --connections) while requests
# that compute for 50 ms (GET /burn) arrive at --burn-rate a second on fresh
# connections. A worker busy computing should not be handed new connections
# that a less busy one could serve: NeverBlock stops accepting at its
# adaptive limit (the kernel's queue then feeds the other workers); Puma 8
# delays a busy worker's accept (`wait_for_less_busy_worker 0.005`).
# Target: NeverBlock's p99 of the fast requests at or below Puma's.
#
#   bench/run balance                -> bench/results/balance.{txt,csv,svg}
#   bench/run balance --quick        5 s cells, one round
#
# The burn rate (10/s, 0.5 CPU-seconds a second, a quarter of this 2-core
# machine) is not "one request in 20": wrk's closed loop sends thousands of
# fast requests a second, and one in 20 of those at 50 ms each would need
# more CPU than the machine has.

require_relative "support/harness"
require_relative "support/servers"
require "net/http"

module NeverBlockBench
  # Runs the balancing benchmark and reports it. See the file comment.
  class BalanceBench
    APP = File.expand_path("support/balance_app.ru", __dir__)
    DEFAULTS = { duration: 15, connections: 32, burn_rate: 10, workers: 4, runs: 3, only: %w[neverblock puma],
                 out: RESULTS }.freeze
    QUICK = { duration: 5, runs: 1 }.freeze

    def initialize(options)
      @options = options
      @results = Hash.new { |hash, key| hash[key] = [] }
    end

    # @return [Boolean] true when every cell ran
    def call
      problem = PeerServers.problem
      abort problem if problem && @options[:only].include?("puma")
      puts header
      @options[:runs].times do |round|
        @options[:only].each do |name|
          result = measure(name)
          @results[name] << result
          warn format("  %-10s run %d: fast p50 %.1f ms, p99 %.1f ms, %.0f req/s, %d burns", name, round + 1,
                      result[:p50] * 1000, result[:p99] * 1000, result[:rps], result[:burns])
        end
      end
      report
      true
    ensure
      ServerProcess.stop_all
    end

    private

    def header
      <<~TEXT
        Balancing across #{@options[:workers]} workers: fast requests (wrk -c #{@options[:connections]}) while #{@options[:burn_rate]}/s requests compute 50 ms each
        #{Machine.ruby_description}
        neverblock #{NeverBlock::VERSION} (#{Checkout.description}); puma #{PeerServers.locked_versions['puma']} (wait_for_less_busy_worker 0.005); #{Wrk.version}
        #{Machine.description}; wrk, the burn requests and the servers on the same machine
        load average at start: #{Machine.load_average}
      TEXT
    end

    def measure(name)
      server = start(name)
      server.wait_until_ready
      sleep 1 # every worker up
      Wrk.run("http://127.0.0.1:#{server.port}/", connections: @options[:connections], duration: 2) # warm-up
      burns = Burns.new(server.port, @options[:burn_rate])
      result = Wrk.run("http://127.0.0.1:#{server.port}/", connections: @options[:connections], duration: @options[:duration])
      { p50: result.p50, p99: result.p99, rps: result.requests_per_second, errors: result.errors, burns: burns.stop }
    ensure
      server&.stop
    end

    def start(name)
      port = ServerProcess.free_port
      workers = @options[:workers].to_s
      if name == "neverblock"
        ServerProcess.start("neverblock", [RbConfig.ruby, File.join(PeerServers::REPO, "exe/neverblock"), "serve", APP,
                                           "-w", workers, "-b", "tcp://127.0.0.1:#{port}", "-E", "production"], port: port)
      else
        config = File.join(Dir.mktmpdir("neverblock-bench-puma-"), "puma.rb")
        File.write(config, "wait_for_less_busy_worker 0.005\n")
        PeerServers.peer("puma", ["bundle", "exec", "puma", "-C", config, "--environment", "production", "--workers", workers,
                                  "--bind", "tcp://127.0.0.1:#{port}", APP], port, { "RACK_ENV" => "production" })
      end
    end

    # GET /burn at `rate` a second on fresh connections, each in a thread
    # of its own, until #stop (which answers how many completed).
    class Burns
      def initialize(port, rate)
        @done = 0
        @stop = false
        @lock = Thread::Mutex.new
        @threads = []
        @ticker = Thread.new do
          until @stop
            @threads << Thread.new do
              Net::HTTP.get_response(URI("http://127.0.0.1:#{port}/burn"))
              @lock.synchronize { @done += 1 }
            rescue StandardError
              nil
            end
            sleep 1.0 / rate
          end
        end
      end

      def stop
        @stop = true
        @ticker.join
        @threads.each { |thread| thread.join(10) }
        @done
      end
    end

    def report
      rows = @results.map do |name, runs|
        median = ->(key) { runs.map { |run| run[key] }.sort[runs.size / 2] }
        [name, (median.call(:p50) * 1000).round(2), (median.call(:p99) * 1000).round(2), median.call(:rps).round,
         runs.sum { |run| run[:errors] }, median.call(:burns)]
      end
      headers = ["server", "fast p50 ms", "fast p99 ms", "fast req/s", "errors", "burns"]
      table = Table.new(headers, align: %i[left right right right right right])
      rows.each { |row| table << row }
      puts "\nload average at end: #{Machine.load_average}\nmedians of #{@options[:runs]} interleaved runs\n\n#{table}"
      neverblock = rows.find { |row| row[0] == "neverblock" }
      puma = rows.find { |row| row[0] == "puma" }
      puts "\nNeverBlock's fast p99 / Puma's: #{format('%.2f', neverblock[2] / puma[2])} (target <= 1)" if neverblock && puma
      chart = SvgChart.new(title: "Fast requests' latency beside 50 ms CPU requests, #{@options[:workers]} workers",
                           subtitle: [Machine.ruby_description, Machine.description])
      chart.add_panel(title: "fast requests (ms, lower is better)", categories: ["p50", "p99"],
                      series: rows.to_h { |row| [row[0], [row[1], row[2]]] })
      NeverBlockBench.write_results(@options[:out], "balance", headers, rows, chart)
    end
  end
end

if $PROGRAM_NAME == __FILE__
  require "neverblock"
  NeverBlockBench::CommandLine.main(NeverBlockBench::BalanceBench, "balance", variants: "neverblock,puma") do |opts, options|
    opts.on("--duration SECONDS", Integer, "seconds of each measured cell (15)") { |v| options[:duration] = v }
    opts.on("--connections N", Integer, "wrk's connections for the fast requests (32)") { |v| options[:connections] = v }
    opts.on("--burn-rate N", Integer, "50 ms CPU requests a second (10)") { |v| options[:burn_rate] = v }
    opts.on("--runs N", Integer, "interleaved rounds (3)") { |v| options[:runs] = v }
  end
end
