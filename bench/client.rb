#!/usr/bin/env ruby
# frozen_string_literal: true

# The 2009 "Ruby networking on steroids" table: requests/s one Ruby process
# gets from a slow but endlessly scalable HTTP back end (the local delay
# server, another process), by server delay, for a blocking client, a thread
# per request, Async, and NeverBlock (a task per request, and a FiberPool).
#
#   bench/run client --runs 3               Ruby 3.1 -> bench/results/client.{txt,csv,svg}
#   bench/run --ruby 3.3 client --runs 3    Ruby 3.3, newest async -> bench/results/ruby33/
#   bench/run client --quick                smoke run: 50 requests, 0 and 10 ms
#
# Every request is a GET over a fresh Net::HTTP connection; each cell is the
# best of --runs runs, each in a forked process. The blocking client runs only
# as many requests as fit in --blocking-budget seconds (marked * in the table).
# NeverBlock and Async run on the same io-event selector (--selector, EPoll).

require_relative "support/harness"
require_relative "support/delay_server"
require_relative "support/http_get"

module NeverBlockBench
  # Runs the client benchmark and reports it. See the file comment.
  class ClientBench
    # One way of issuing `count` requests: `run` gets the count and a callable
    # making one request (nil or an error string) and returns its results.
    Client = Struct.new(:name, :label, :library, :run, keyword_init: true)

    DEFAULTS = { requests: 1000, delays_ms: [0, 10, 50, 100, 500], pool_size: nil, blocking_budget: 10.0, runs: 1,
                 out: RESULTS, selector: Peers::DEFAULT_SELECTOR }.freeze
    QUICK = { requests: 50, delays_ms: [0, 10], blocking_budget: 1.0 }.freeze
    REQUEST_OVERHEAD = 0.001 # seconds of client work per request, to size the blocking runs

    def initialize(options)
      @options = options
      @options[:pool_size] ||= @options[:requests]
      @clients = CommandLine.select(clients(@options[:pool_size]), @options[:only])
    end

    # @return [Boolean] true when every request of every cell succeeded
    def call
      Machine.raise_fd_limit(DelayServer::FD_LIMIT)
      @probe = Peers.start(@options[:selector]) { |probe, selector| header(probe, @selector = selector) } or return false
      server = DelayServer.start
      results = @options[:delays_ms].flat_map { |ms| @clients.map { |client| measure(server, client, ms) } }
      server_ok = server.stop
      report(results)
      warn "delay server did not exit cleanly" unless server_ok
      server_ok && results.all? { |result| result[:errors].zero? && !result[:failure] }
    end

    private

    def clients(pool_size)
      spawn_all = ->(count, &spawn) { NeverBlock.run { NeverBlock.wait_all(Array.new(count) { spawn.call }) } }
      [Client.new(name: "blocking", label: "blocking (sequential)", run: ->(count, get) { Array.new(count) { get.call } }),
       Client.new(name: "threads", label: "threads (1 per request)", run: lambda do |count, get|
         Thread.report_on_exception = false
         Array.new(count) { Thread.new { get.call } }.map(&:value)
       end),
       Client.new(name: "async", label: "async #{Machine.gem_version('async')} (1 task per request)", library: "async",
                  run: ->(count, get) { Async { |task| Array.new(count) { task.async { get.call } }.map(&:wait) }.wait }),
       Client.new(name: "neverblock", label: "NeverBlock.spawn (1 per request)", library: "neverblock",
                  run: ->(count, get) { spawn_all.call(count) { NeverBlock.spawn { get.call } } }),
       Client.new(name: "pool", label: "NeverBlock::FiberPool(size: #{pool_size})", library: "neverblock",
                  run: lambda do |count, get|
                    pool = nil
                    spawn_all.call(count) { (pool ||= NeverBlock::FiberPool.new(size: pool_size, queue_limit: count)).spawn { get.call } }
                  end)]
    end

    def header(probe, selector)
      <<~TEXT
        NeverBlock client benchmark: requests/s by server delay (the 2009 "Ruby networking on steroids" table)
        #{Machine.ruby_description}
        #{Peers.versions_text(probe)}; #{Machine.description}
        #{Peers.selector_text(probe, selector)}
        #{@options[:requests]} requests per cell, each a GET on a fresh Net::HTTP connection to a local delay server
        (one process, single-threaded event loop, same machine); each cell is #{@options[:runs] == 1 ? 'one run' : "the best of #{@options[:runs]} runs, each"} in a forked process.
        load average at start: #{Machine.load_average}
      TEXT
    end

    # One cell: the fastest of --runs runs, or a failed one. Each run makes
    # `count` requests in a forked child.
    # @return [Hash] :client, :delay_ms, :requests, :seconds, :errors, :first_error, :failure
    def measure(server, client, delay_ms)
      count = client.name == "blocking" ? (@options[:blocking_budget] / ((delay_ms / 1000.0) + REQUEST_OVERHEAD)).floor.clamp(1, @options[:requests]) : @options[:requests]
      path = DelayServer.path_for(delay_ms / 1000.0)
      timeout = 60 + ((client.name == "blocking" ? count * ((delay_ms / 1000.0) + REQUEST_OVERHEAD) : delay_ms / 1000.0) * 3)
      runs = Array.new(@options[:runs]) do
        outcome = Isolated.run(timeout: timeout) do
          Machine.raise_fd_limit(count + 1024)
          require client.library if client.library
          get = -> { HTTPGet.call(server.host, server.port, path) }
          HTTPGet.call(server.host, server.port, "/") # warm up Net::HTTP's code paths, outside the timing
          started = NeverBlockBench.now
          errors = client.run.call(count, get).compact
          { seconds: NeverBlockBench.now - started, errors: errors.size, first_error: errors.first, failure: nil }
        end
        outcome = { seconds: nil, errors: 0, failure: outcome.to_s } if outcome.is_a?(Isolated::Failure)
        { client: client, delay_ms: delay_ms, requests: count }.merge(outcome)
      end
      result = runs.find { |run| run[:failure] || run[:errors].positive? } || runs.min_by { |run| run[:seconds] }
      warn "  #{client.name} @ #{delay_ms} ms: " +
           (result[:failure] ? "FAILED #{result[:failure]}" : format("%d requests in %.2f s = %s req/s", count, result[:seconds], SvgChart.format_number(rate(result)))) +
           (result[:errors].positive? ? " (#{result[:errors]} failed: #{result[:first_error]})" : "")
      result
    end

    def rate(result)
      result[:seconds]&.positive? ? (result[:requests] - result[:errors]) / result[:seconds] : nil
    end

    def find(results, client, delay_ms)
      results.find { |result| result[:client].equal?(client) && result[:delay_ms] == delay_ms }
    end

    def report(results)
      delays = @options[:delays_ms]
      puts "\nload average at end: #{Machine.load_average}"
      puts "async and NeverBlock cells on io-event #{@selector}" if @clients.any?(&:library)
      table = Table.new(["client \\ server delay"] + delays.map { |ms| "#{ms} ms" })
      @clients.each do |client|
        table << [client.label] + delays.map do |ms|
          result = find(results, client, ms)
          next "failed" if result[:failure]

          "#{SvgChart.format_number(rate(result))}#{'*' if result[:requests] < @options[:requests]}#{'!' if result[:errors].positive?}"
        end
      end
      puts table
      capped = results.select { |result| result[:requests] < @options[:requests] }
      puts "* fewer requests, to finish in about #{@options[:blocking_budget]} s: #{capped.map { |r| "#{r[:requests]} at #{r[:delay_ms]} ms" }.join(', ')}" if capped.any?
      results.select { |r| r[:errors].positive? }.each do |r|
        puts "! #{r[:client].name} @ #{r[:delay_ms]} ms: #{r[:errors]} requests failed, first: #{r[:first_error]} (rate counts successes only)"
      end
      results.select { |r| r[:failure] }.each { |r| puts "failed: #{r[:client].name} @ #{r[:delay_ms]} ms: #{r[:failure]}" }
      # NeverBlock's rate against threads' (the 2009 "NeverBlock advantage" row) and Async's.
      if (nb = @clients.find { |client| client.name == "neverblock" }) && (others = @clients.select { |c| %w[threads async].include?(c.name) }).any?
        table = Table.new(["NeverBlock.spawn vs"] + delays.map { |ms| "#{ms} ms" })
        others.each do |other|
          table << [other.name] + delays.map do |ms|
            mine, theirs = rate(find(results, nb, ms)), rate(find(results, other, ms)) # rubocop:disable Style/ParallelAssignment
            mine && theirs ? format("%.2fx", mine / theirs) : "-"
          end
        end
        puts "\n#{table}"
      end
      rows = results.map do |r|
        [r[:client].name, r[:client].label, r[:delay_ms], r[:requests], r[:seconds]&.round(4), rate(r)&.round(1), r[:errors],
         (@selector if r[:client].library), r[:failure] || (r[:first_error] if r[:errors].positive?)]
      end
      chart = SvgChart.new(title: "Requests/s by server delay, #{@options[:requests]} requests",
                           subtitle: ["ruby #{RUBY_VERSION}, #{Machine.description}",
                                      "#{Peers.versions_text(@probe)}, #{@selector} selector for both; fresh Net::HTTP connection per request"])
      chart.add_panel(title: "requests/s (higher is better)", log: true, categories: delays.map { |ms| "#{ms} ms" },
                      series: @clients.to_h { |client| [client.label, delays.map { |ms| rate(find(results, client, ms)) }] })
      NeverBlockBench.write_results(@options[:out], "client", %w[client label delay_ms requests seconds requests_per_s errors selector note],
                                    rows, chart)
    end
  end
end

if $PROGRAM_NAME == __FILE__
  NeverBlockBench::CommandLine.main(NeverBlockBench::ClientBench, "client", variants: "blocking,threads,async,neverblock,pool") do |opts, options|
    opts.on("--requests N", Integer, "requests per cell (1000)") { |value| options[:requests] = value }
    opts.on("--delays LIST", Array, "server delays in ms (0,10,50,100,500)") { |list| options[:delays_ms] = list.map { |v| Integer(v) } }
    opts.on("--pool-size N", Integer, "FiberPool size (default: --requests)") { |value| options[:pool_size] = value }
    opts.on("--blocking-budget SECONDS", Float, "seconds the blocking client may take per cell (10)") { |value| options[:blocking_budget] = value }
    opts.on("--runs N", Integer, "runs per cell, best reported (1)") { |value| options[:runs] = value }
  end
end
