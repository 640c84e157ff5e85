#!/usr/bin/env ruby
# frozen_string_literal: true

# The 2009 "Ruby networking on steroids" table, rebuilt: requests/s that one
# Ruby process gets from a slow but endlessly scalable HTTP back end, by
# server delay, for a blocking client, a thread per request, Async, and
# NeverBlock (a task per request, and a FiberPool).
#
#   bench/run client [options]              Ruby 3.1 (bench/results/)
#   bench/run --ruby 3.3 client [options]   Ruby 3.3, newest async (bench/results/ruby33/)
#   BUNDLE_PATH=vendor/bundle bundle exec ruby bench/client.rb
#   ... bench/client.rb --requests 200 --delays 0,100 --only threads,neverblock
#
# Every request is a GET over a fresh Net::HTTP connection to a local delay
# server (bench/support/delay_server.rb, another process on this machine).
# Each cell is one run in its own forked process. The blocking client would
# need 1000 x delay seconds, so it runs only as many requests as fit in about
# --blocking-budget seconds; the table marks those cells.
#
# NeverBlock and Async run on the same io-event selector, --selector (EPoll
# unless told): io-event's own default, which Async would otherwise take, is
# URing where liburing was there at build time, while NeverBlock's is EPoll.
# The header says which selector each library was seen to use.
#
# Writes <out>/client.csv and <out>/client.svg (default out: bench/results).

require_relative "support/harness"
require_relative "support/delay_server"
require_relative "support/http_get"

module NeverBlockBench
  # Runs the client benchmark and reports it. See the file comment.
  class ClientBench
    # One way of issuing `count` requests. `run` gets the count and a
    # callable that makes one request and returns nil or an error string;
    # it returns the callable's results.
    Client = Struct.new(:name, :label, :library, :run, keyword_init: true)

    DEFAULTS = {
      requests: 1000,
      delays_ms: [0, 10, 50, 100, 500],
      only: nil,
      out: File.expand_path("results", __dir__),
      pool_size: nil, # nil: one fiber per request
      blocking_budget: 10.0,
      runs: 1,
      selector: Peers::DEFAULT_SELECTOR
    }.freeze

    # Seconds of client work per request beyond the delay, for sizing the
    # capped blocking runs. A guess; the cap only needs to be roughly right.
    REQUEST_OVERHEAD = 0.001

    def initialize(options)
      @options = DEFAULTS.merge(options)
      @options[:pool_size] ||= @options[:requests]
      @clients = select_clients(all_clients, @options[:only])
    end

    # Runs every cell, prints the tables, writes CSV and SVG.
    #
    # @return [Boolean] true when every request of every cell succeeded
    def call
      Machine.raise_fd_limit(DelayServer::FD_LIMIT)
      @selector = Peers.use_selector(@options[:selector])
      @probe = Peers.probe
      puts header
      unless Peers.selector_matches?(@probe, @selector)
        warn "NeverBlock and async are not on the same selector (see above); not measuring"
        return false
      end
      server = DelayServer.start
      results = measure_all(server)
      server_ok = server.stop
      report(results)
      warn "delay server did not exit cleanly" unless server_ok
      results.all? { |result| result[:errors].zero? && result[:failure].nil? } && server_ok
    end

    private

    def all_clients
      pool_size = @options[:pool_size]
      [
        Client.new(name: "blocking", label: "blocking (sequential)", library: nil,
                   run: ->(count, get) { Array.new(count) { get.call } }),
        Client.new(name: "threads", label: "threads (1 per request)", library: nil,
                   run: lambda do |count, get|
                     Thread.report_on_exception = false
                     Array.new(count) { Thread.new { get.call } }.map(&:value)
                   end),
        Client.new(name: "async", label: "async #{Machine.gem_version('async')} (1 task per request)",
                   library: "async",
                   run: lambda do |count, get|
                     Async { |task| Array.new(count) { task.async { get.call } }.map(&:wait) }.wait
                   end),
        Client.new(name: "neverblock", label: "NeverBlock.spawn (1 per request)", library: "neverblock",
                   run: lambda do |count, get|
                     NeverBlock.run { NeverBlock.wait_all(Array.new(count) { NeverBlock.spawn { get.call } }) }
                   end),
        Client.new(name: "pool", label: "NeverBlock::FiberPool(size: #{pool_size})", library: "neverblock",
                   run: lambda do |count, get|
                     NeverBlock.run do
                       pool = NeverBlock::FiberPool.new(size: pool_size, queue_limit: count)
                       values = NeverBlock.wait_all(Array.new(count) { pool.spawn { get.call } })
                       pool.shutdown
                       values
                     end
                   end)
      ]
    end

    def select_clients(clients, only)
      return clients unless only

      unknown = only - clients.map(&:name)
      raise OptionParser::InvalidArgument, "unknown client(s) #{unknown.join(', ')}" unless unknown.empty?

      clients.select { |client| only.include?(client.name) }
    end

    def header
      <<~TEXT
        NeverBlock client benchmark: requests/s by server delay (the 2009 "Ruby networking on steroids" table)
        #{Machine.ruby_description}
        #{Peers.versions_text(@probe)}; #{Machine.description}
        #{Peers.selector_text(@probe, @selector)}
        #{@options[:requests]} requests per cell, each a GET on a fresh Net::HTTP connection to a local delay server
        (one process, single-threaded event loop, same machine); each cell is #{runs_text} in a forked process.
        load average at start: #{Machine.load_average}
      TEXT
    end

    def runs_text
      @options[:runs] == 1 ? "one run" : "the best of #{@options[:runs]} runs, each"
    end

    def measure_all(server)
      @options[:delays_ms].flat_map do |delay_ms|
        @clients.map do |client|
          result = measure(server, client, delay_ms)
          warn progress_line(result)
          result
        end
      end
    end

    # One cell: the best of --runs runs (fastest without a failed run; any
    # failed run is reported instead).
    #
    # @return [Hash] see {#measure_once}
    def measure(server, client, delay_ms)
      runs = Array.new(@options[:runs]) { measure_once(server, client, delay_ms) }
      runs.find { |run| run[:failure] || run[:errors].positive? } || runs.min_by { |run| run[:seconds] }
    end

    # One run of a cell: `count` requests by `client` at `delay_ms`, in a
    # forked child.
    #
    # @return [Hash] :client, :delay_ms, :requests, :seconds, :errors,
    #   :first_error, :failure (why the cell produced no number, or nil)
    def measure_once(server, client, delay_ms)
      count = request_count(client, delay_ms)
      path = DelayServer.path_for(delay_ms / 1000.0)
      host = server.host
      port = server.port
      outcome = Isolated.run(timeout: cell_timeout(client, count, delay_ms)) do
        Machine.raise_fd_limit(count + 1024)
        require client.library if client.library
        get = -> { HTTPGet.call(host, port, path) }
        HTTPGet.call(host, port, "/") # warm up Net::HTTP's code paths, outside the timing
        started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        errors = client.run.call(count, get).compact
        { seconds: Process.clock_gettime(Process::CLOCK_MONOTONIC) - started,
          errors: errors.size, first_error: errors.first }
      end
      base = { client: client, delay_ms: delay_ms, requests: count }
      return base.merge(seconds: nil, errors: 0, first_error: nil, failure: outcome.to_s) if outcome.is_a?(Isolated::Failure)

      base.merge(outcome).merge(failure: nil)
    end

    def request_count(client, delay_ms)
      requests = @options[:requests]
      return requests unless client.name == "blocking"

      affordable = (@options[:blocking_budget] / ((delay_ms / 1000.0) + REQUEST_OVERHEAD)).floor
      affordable.clamp(1, requests)
    end

    # Seconds before a cell is given up: generous, since the machine is noisy.
    def cell_timeout(client, count, delay_ms)
      ideal = client.name == "blocking" ? count * ((delay_ms / 1000.0) + REQUEST_OVERHEAD) : delay_ms / 1000.0
      60 + (ideal * 3)
    end

    def progress_line(result)
      cell = "#{result[:client].name} @ #{result[:delay_ms]} ms"
      return "  #{cell}: FAILED #{result[:failure]}" if result[:failure]

      line = format("  %s: %d requests in %.2f s = %s req/s", cell, result[:requests], result[:seconds],
                    SvgChart.format_number(rate(result)))
      line += " (#{result[:errors]} failed: #{result[:first_error]})" if result[:errors].positive?
      line
    end

    def rate(result)
      result[:seconds] && result[:seconds].positive? ? (result[:requests] - result[:errors]) / result[:seconds] : nil
    end

    def report(results)
      puts "\nload average at end: #{Machine.load_average}"
      puts "async and NeverBlock cells on io-event #{@selector}" if @clients.any? { |client| client.library }
      puts rates_table(results)
      notes = footnotes(results)
      puts notes unless notes.empty?
      comparison = comparison_table(results)
      puts "\n#{comparison}" if comparison
      FileUtils.mkdir_p(@options[:out])
      csv = write_csv(results)
      svg = write_svg(results)
      puts "\nwrote #{CommandLine.relative(csv)} and #{CommandLine.relative(svg)}"
    end

    def rates_table(results)
      table = Table.new(["client \\ server delay"] + @options[:delays_ms].map { |ms| "#{ms} ms" })
      @clients.each do |client|
        table << [client.label] + @options[:delays_ms].map { |ms| cell_text(find(results, client, ms)) }
      end
      table.to_s
    end

    def cell_text(result)
      return "failed" if result[:failure]

      text = SvgChart.format_number(rate(result))
      text += "*" if result[:requests] < @options[:requests]
      text += "!" if result[:errors].positive?
      text
    end

    def footnotes(results)
      notes = []
      capped = results.select { |result| result[:requests] < @options[:requests] }
      unless capped.empty?
        counts = capped.map { |result| "#{result[:requests]} at #{result[:delay_ms]} ms" }.join(", ")
        notes << "* fewer requests, to finish in about #{@options[:blocking_budget]} s: #{counts}"
      end
      results.select { |result| result[:errors].positive? }.each do |result|
        notes << "! #{result[:client].name} @ #{result[:delay_ms]} ms: #{result[:errors]} requests failed, " \
                 "first: #{result[:first_error]} (rate counts successes only)"
      end
      results.select { |result| result[:failure] }.each do |result|
        notes << "failed: #{result[:client].name} @ #{result[:delay_ms]} ms: #{result[:failure]}"
      end
      notes.map { |note| "#{note}\n" }.join
    end

    # NeverBlock's rate against the thread-per-request client's, as the 2009
    # "NeverBlock advantage" row did, and against Async's.
    def comparison_table(results)
      nb = @clients.find { |client| client.name == "neverblock" }
      others = @clients.select { |client| %w[threads async].include?(client.name) }
      return nil unless nb && !others.empty?

      table = Table.new(["NeverBlock.spawn vs"] + @options[:delays_ms].map { |ms| "#{ms} ms" })
      others.each do |other|
        table << [other.name] + @options[:delays_ms].map do |ms|
          mine = rate(find(results, nb, ms))
          theirs = rate(find(results, other, ms))
          mine && theirs ? format("%.2fx", mine / theirs) : "-"
        end
      end
      table.to_s
    end

    def find(results, client, delay_ms)
      results.find { |result| result[:client].equal?(client) && result[:delay_ms] == delay_ms }
    end

    def write_csv(results)
      path = File.join(@options[:out], "client.csv")
      rows = results.map do |result|
        value = rate(result)
        note = result[:failure] || (result[:errors].positive? ? result[:first_error] : nil)
        [result[:client].name, result[:client].label, result[:delay_ms], result[:requests],
         result[:seconds]&.round(4), value&.round(1), result[:errors], (@selector if result[:client].library), note]
      end
      File.write(path, csv_text(%w[client label delay_ms requests seconds requests_per_s errors selector note], rows))
      path
    end

    def csv_text(headers, rows)
      ([headers] + rows).map { |row| row.map { |cell| csv_cell(cell) }.join(",") }.join("\n") + "\n"
    end

    def csv_cell(cell)
      text = cell.to_s
      text.match?(/[",\n]/) ? "\"#{text.gsub('"', '""')}\"" : text
    end

    def write_svg(results)
      chart = SvgChart.new(title: "Requests/s by server delay, #{@options[:requests]} requests",
                           subtitle: ["ruby #{RUBY_VERSION}, #{Machine.description}",
                                      "#{Peers.versions_text(@probe)}, #{@selector} selector for both; " \
                                      "fresh Net::HTTP connection per request"])
      series = @clients.to_h do |client|
        [client.label, @options[:delays_ms].map { |ms| rate(find(results, client, ms)) }]
      end
      chart.add_panel(title: "requests/s (higher is better)", log: true,
                      categories: @options[:delays_ms].map { |ms| "#{ms} ms" }, series: series)
      chart.write(File.join(@options[:out], "client.svg"))
    end
  end
end

if $PROGRAM_NAME == __FILE__
  options = {}
  parser = OptionParser.new do |opts|
    opts.banner = "Usage: ruby bench/client.rb [options]"
    opts.on("--requests N", Integer, "requests per cell (1000)") { |value| options[:requests] = value }
    opts.on("--delays LIST", Array, "server delays in ms (0,10,50,100,500)") do |list|
      options[:delays_ms] = list.map { |value| Integer(value) }
    end
    opts.on("--pool-size N", Integer, "FiberPool size (default: --requests)") { |value| options[:pool_size] = value }
    opts.on("--blocking-budget SECONDS", Float, "seconds the blocking client may take per cell (10)") do |value|
      options[:blocking_budget] = value
    end
    opts.on("--runs N", Integer, "runs per cell, best reported (1)") { |value| options[:runs] = value }
    NeverBlockBench::CommandLine.shared_options(opts, options, results: "client",
                                                               variants: "blocking,threads,async,neverblock,pool")
  end
  NeverBlockBench::CommandLine.run(parser) { NeverBlockBench::ClientBench.new(options).call }
end
