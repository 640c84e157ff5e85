#!/usr/bin/env ruby
# frozen_string_literal: true

# 2009's "Ruby networking on steroids": requests/s one process gets from a
# slow but endlessly scalable back end (support/delay_server.rb), by its
# delay, for a blocking client, a thread per request, Async, NeverBlock.spawn
# and a FiberPool; each request a GET on a fresh Net::HTTP connection; each
# cell the best of --runs forked runs. The blocking client sends only what
# fits in --blocking-budget seconds (* in the table).
#
#   bench/run client --runs 3               Ruby 3.1 -> bench/results/client.{txt,csv,svg}
#   bench/run --ruby 3.3 client --runs 3    Ruby 3.3, newest async -> bench/results/ruby33/
#   bench/run client --quick                smoke run: 50 requests, 0 and 10 ms

require_relative "support/harness"
require_relative "support/delay_server"

module NeverBlockBench
  class ClientBench < Bench
    # `run.(count, get)` makes `count` requests with `get` (nil or an error string each) and returns their results.
    Client = Struct.new(:name, :label, :library, :run, keyword_init: true)

    DEFAULTS = { requests: 1000, delays: [0, 10, 50, 100, 500], pool_size: nil, blocking_budget: 10.0, runs: 1 }.freeze
    QUICK = { requests: 50, delays: [0, 10], blocking_budget: 1.0 }.freeze
    ONLY = %w[blocking threads async neverblock pool].freeze
    REQUEST_OVERHEAD = 0.001 # seconds of client work per request, to size the blocking runs

    def initialize(options)
      super
      @clients = clients(@options[:pool_size] ||= @options[:requests]).select { |client| @options[:only].include?(client.name) }
    end

    # @return [Boolean] true when every request of every cell succeeded
    def call
      @probe = Peers.start { |probe| header(probe) } or return false
      server = DelayServer.start
      cells = @options[:delays].product(@clients).map { |delay_ms, client| cell(client, delay_ms) }
      NeverBlockBench.rounds(cells, @options[:runs], timeout: ->(cell) { cell[:timeout] }) { |cell| measure(server, cell) }
      report(cells)
      warn "delay server did not exit cleanly" unless (server_ok = server.stop)
      server_ok && cells.none? { |cell| cell.failures.any? }
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

    def header(probe)
      runs = @options[:runs] == 1 ? "one run" : "the best of #{@options[:runs]} runs, each"
      NeverBlockBench.header(
        'NeverBlock client benchmark: requests/s by server delay (the 2009 "Ruby networking on steroids" table)',
        Peers.text(probe),
        "#{@options[:requests]} requests per cell, each a GET on a fresh Net::HTTP connection to a local delay server",
        "(one process, single-threaded event loop, same machine); each cell is #{runs} in a forked process."
      )
    end

    # `client` at `delay_ms`: the blocking client makes only as many requests as fit in --blocking-budget.
    def cell(client, delay_ms)
      each = (delay_ms / 1000.0) + REQUEST_OVERHEAD
      count = client.name == "blocking" ? (@options[:blocking_budget] / each).floor.clamp(1, @options[:requests]) : @options[:requests]
      timeout = 60 + ((client.name == "blocking" ? count * each : delay_ms / 1000.0) * 3)
      Cell.new("#{client.name} @ #{delay_ms} ms", client: client, delay_ms: delay_ms, requests: count, timeout: timeout)
    end

    # In the child: the seconds the cell's requests took; a failed request fails the run.
    def measure(server, cell)
      Machine.raise_fd_limit(cell[:requests] + 1024)
      require cell[:client].library if cell[:client].library
      path = DelayServer.path_for(cell[:delay_ms] / 1000.0)
      HTTPGet.call(server.host, server.port, "/") # warm up Net::HTTP's code paths, outside the timing
      get = -> { HTTPGet.call(server.host, server.port, path) }
      errors = nil
      seconds = NeverBlockBench.timed { errors = cell[:client].run.call(cell[:requests], get).compact }
      raise "#{errors.size} of #{cell[:requests]} requests failed, first: #{errors.first}" if errors.any?

      seconds
    end

    # @return [Float, nil] requests/s of the cell's fastest run
    def rate(cell) = cell.runs.min&.then { |seconds| cell[:requests] / seconds }

    def report(cells)
      delays = @options[:delays]
      find = ->(client, delay_ms) { cells.find { |cell| cell[:client].equal?(client) && cell[:delay_ms] == delay_ms } }
      table = Table.new(["client \\ server delay"] + delays.map { |ms| "#{ms} ms" })
      @clients.each do |client|
        table << [client.label] + delays.map do |ms|
          cell = find.call(client, ms)
          next "failed" unless rate(cell)

          "#{SvgChart.format_number(rate(cell))}#{'*' if cell[:requests] < @options[:requests]}#{'!' if cell.failures.any?}"
        end
      end
      puts table
      capped = cells.select { |cell| cell[:requests] < @options[:requests] }
      puts "* fewer requests, to finish in about #{@options[:blocking_budget]} s: #{capped.map { |c| "#{c[:requests]} at #{c[:delay_ms]} ms" }.join(', ')}" if capped.any?
      cells.each { |cell| puts "! #{cell.name}: #{cell.failures.size} failed runs, first: #{cell.failures.first}" if cell.failures.any? }
      # NeverBlock's rate against threads' (2009's "NeverBlock advantage") and Async's.
      if (nb = @clients.find { |client| client.name == "neverblock" }) && (others = @clients.select { |c| %w[threads async].include?(c.name) }).any?
        table = Table.new(["NeverBlock.spawn vs"] + delays.map { |ms| "#{ms} ms" })
        others.each do |other|
          table << [other.name] + delays.map do |ms|
            mine, theirs = rate(find.call(nb, ms)), rate(find.call(other, ms)) # rubocop:disable Style/ParallelAssignment
            mine && theirs ? format("%.2fx", mine / theirs) : "-"
          end
        end
        puts "\n#{table}"
      end
      rows = cells.map do |cell|
        { "client" => cell[:client].name, "label" => cell[:client].label, "delay_ms" => cell[:delay_ms], "requests" => cell[:requests],
          "seconds" => cell.runs.min&.round(4), "requests_per_s" => rate(cell)&.round(1), "failed_runs" => cell.failures.size,
          "note" => cell.failures.first }
      end
      chart = NeverBlockBench.chart("Requests/s by server delay, #{@options[:requests]} requests",
                                    "#{Peers.text(@probe)}; a fresh Net::HTTP connection per request")
      chart.pivot("requests/s by server delay, ms (higher is better)", "requests_per_s", by: "delay_ms", series: "label", log: true)
      NeverBlockBench.write_results(@options[:out], "client", rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::ClientBench, "client") if $PROGRAM_NAME == __FILE__
