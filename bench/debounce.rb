#!/usr/bin/env ruby
# frozen_string_literal: true

# A restart storm: --clients clients at once GET /config from an upstream
# that takes --delay and counts its requests, through nothing (none),
# NeverBlock::Debouncer in the upstream (middleware), `neverblock debounce`
# in front (proxy), the same with two workers electing a leader per key
# through Redis (proxy+redis, needs NEVERBLOCK_REDIS_URL: bench/run starts
# Redis), and nginx with proxy_cache_lock. Medians over --runs (each a fresh
# URL) of the upstream requests and the clients' latency (request sent to
# last byte). Targets: 1 upstream request, p99 <= 1.2x one upstream call and
# below nginx's.
#
#   bench/run debounce [--clients 500] [--delay 0.2] [--runs 3]
#   bench/run debounce --quick        smoke run: 50 clients, one run

require_relative "support/harness"
require "net/http"
require "neverblock"
require_relative "support/servers"

module NeverBlockBench
  class DebounceBench < Bench
    EXE = File.join(PeerServers::REPO, "exe", "neverblock")
    UPSTREAM = File.join(__dir__, "support", "debounce_upstream.ru")
    DEFAULTS = { clients: 500, delay: 0.2, runs: 3 }.freeze
    QUICK = { clients: 50, runs: 1 }.freeze
    ONLY = %w[none middleware proxy proxy+redis nginx].freeze
    # nginx's locations: concurrent misses for one key wait for the first one's response (proxy_cache_lock).
    NGINX_LOCATIONS = <<~LOCATIONS
      location /count { proxy_pass http://app; }
      location / {
        proxy_pass http://app;
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_cache storm;
        proxy_cache_valid 200 1s;
        proxy_cache_lock on;
        proxy_cache_lock_timeout 10s;
        proxy_cache_lock_age 10s;
      }
    LOCATIONS

    # @return [true] (a failed storm shows in its row)
    def call
      Machine.raise_fd_limit(@options[:clients] * 4 + 256)
      report(@options[:only].filter_map { |variant| measure(variant) })
      true
    end

    private

    def measure(variant)
      if variant == "proxy+redis" && !ENV["NEVERBLOCK_REDIS_URL"]
        return warn("skipping proxy+redis: NEVERBLOCK_REDIS_URL is not set (bench/run starts Redis)")
      end

      warn "#{variant}: #{@options[:runs]} storms of #{@options[:clients]} clients"
      env = { "NB_BENCH_DELAY" => @options[:delay].to_s, "NB_BENCH_DEBOUNCE" => variant == "middleware" ? "1" : nil }
      upstream = PeerServers.neverblock(UPSTREAM, env: env, name: "upstream")
      upstream.wait_until_ready(path: "/count")
      front = front_server(variant, upstream.port)&.tap { |server| server.wait_until_ready(path: "/count") }
      runs = Array.new(@options[:runs]) do |run|
        get(upstream.port, "/count") # reset
        latencies, errors = storm((front || upstream).port, "/config?run=#{run}")
        { upstream: Integer(get(upstream.port, "/count")), latencies: latencies.sort, errors: errors }
      end
      summarize(variant, runs)
    ensure
      front&.stop
      upstream&.stop
    end

    # The server the clients talk to in front of the upstream; nil when they talk to it directly.
    def front_server(variant, upstream_port)
      port = ServerProcess.free_port
      case variant
      when "nginx"
        PeerServers.nginx(port: port, dir: scratch, locations: NGINX_LOCATIONS, http: <<~HTTP)
          proxy_cache_path %{prefix}/cache levels=1:2 keys_zone=storm:10m;
          upstream app { server 127.0.0.1:#{upstream_port}; keepalive 64; }
        HTTP
      when "proxy", "proxy+redis"
        workers = variant == "proxy+redis" ? ["-w", "2", "--redis", ENV.fetch("NEVERBLOCK_REDIS_URL")] : %w[-w 0]
        ServerProcess.start(variant, [RbConfig.ruby, EXE, "debounce", "--upstream", "http://127.0.0.1:#{upstream_port}",
                                      *workers, "--listen", "tcp://127.0.0.1:#{port}"], port: port)
      end
    end

    # Opens --clients connections, then sends every GET at once (a storm, not
    # this client's connect rate). @return [Array(Array<Float>, Integer)] the
    # 200 responses' latencies (request sent to last byte) and the count of others
    def storm(port, path)
      latencies = []
      errors = 0
      request = "GET #{path} HTTP/1.1\r\nHost: config.internal\r\nConnection: close\r\n\r\n"
      NeverBlock.run do
        sockets = NeverBlock.map(1..@options[:clients], concurrency: 100) { TCPSocket.new("127.0.0.1", port) }
        go = Thread::Queue.new
        tasks = sockets.map do |socket|
          NeverBlock.spawn do
            go.pop
            started = NeverBlockBench.now
            socket.write(request)
            socket.read.start_with?("HTTP/1.1 200") ? (latencies << (NeverBlockBench.now - started)) : (errors += 1)
          rescue SystemCallError, IOError
            errors += 1
          ensure
            socket.close
          end
        end
        NeverBlock.sleep(0.2) # every client waits on the queue; the servers accepted every connection
        sockets.size.times { go << true }
        NeverBlock.wait_all(tasks)
      end
      [latencies, errors]
    end

    # @return [String] the body, stripped
    def get(port, path) = Net::HTTP.start("127.0.0.1", port, nil) { |http| http.get(path).body.strip }

    # One variant's row: medians over its runs of the upstream requests and of
    # the clients' p50, p99 and max latency, ms (nil where nothing answered).
    def summarize(variant, runs)
      median = ->(values) { NeverBlockBench.percentile(values, 0.5) } # the upper middle one of an even count
      latency_ms = lambda do |q|
        values = runs.filter_map { |run| run[:latencies][[(run[:latencies].size * q).ceil - 1, 0].max] }
        (median.call(values) * 1000).round unless values.empty?
      end
      p99 = latency_ms.call(0.99)
      { "variant" => variant, "clients" => @options[:clients], "upstream_requests" => median.call(runs.map { |run| run[:upstream] }),
        "p50_ms" => latency_ms.call(0.5), "p99_ms" => p99, "max_ms" => latency_ms.call(1.0),
        "p99_vs_upstream_call" => p99&.fdiv(@options[:delay] * 1000)&.round(2), "errors" => runs.sum { |run| run[:errors] } }
    end

    def report(rows)
      delay_ms = (@options[:delay] * 1000).round
      puts NeverBlockBench.header(
        "Restart storm: #{@options[:clients]} clients at once, upstream answers in #{delay_ms} ms (median of #{@options[:runs]} runs)",
        "server, proxies and clients share the machine; connections opened first, then every GET at once;",
        "latency = request sent to last byte"
      ), ""
      nginx_p99 = rows.find { |row| row["variant"] == "nginx" }&.fetch("p99_ms")
      rows.each { |row| row["targets"] = targets(row, nginx_p99, delay_ms) }
      puts Table.of(rows, rows.first.keys - ["clients"]) unless rows.empty?
      chart = NeverBlockBench.chart("Restart storm: #{@options[:clients]} identical GETs at once", "upstream answers in #{delay_ms} ms")
      chart.pivot("upstream requests", "upstream_requests", series: "variant", log: true)
      chart.pivot("client p99 latency, ms", "p99_ms", series: "variant")
      NeverBlockBench.write_results(@options[:out], "debounce", rows, chart)
    end

    def targets(row, nginx_p99, delay_ms)
      return "-" if %w[none nginx].include?(row["variant"])

      p99 = row["p99_ms"] || Float::INFINITY
      met = ->(yes) { yes ? "met" : "NOT met" }
      ["1 request #{met.call(row['upstream_requests'] == 1)}", "p99 <= 1.2x #{met.call(p99 <= 1.2 * delay_ms)}",
       *("p99 < nginx #{met.call(p99 < nginx_p99)}" if nginx_p99)].join(", ")
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::DebounceBench, "debounce") if $PROGRAM_NAME == __FILE__
