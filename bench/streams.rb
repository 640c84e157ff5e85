#!/usr/bin/env ruby
# frozen_string_literal: true

# Many event streams opened at once: a client of --clients forked processes
# opens --streams N text/event-stream responses (GET, each a Rack body's
# `each` of --events events --interval-ms apart, support/streams_app.ru) on
# one server process at once, as fast as it can, and reads them to the end.
# direct: the app makes the events (the fake LLM is in the app); relay: the
# app reads them from a fake LLM upstream (another process, NeverBlock) with
# Net::HTTP's streaming read_body and relays each chunk; live: a Rails app's
# ActionController::Live action writes them (support/streams_live.ru); rails-body: the
# same Rails app's action returns them as a Rack body (`self.response_body =`), the
# baseline of what Live itself costs. Servers: NeverBlock
# (`neverblock serve -w 0`, defaults: fiber_pool 1000, adaptive limit), the
# same with each stream marked IO-bound (env["neverblock.mark_as_io_bound"]),
# Falcon (--count 1), Puma single mode with 5 and 50 threads (a stream holds
# a thread). Per cell, a fresh server: streams complete (all events, then the
# end) by --deadline s; p50/p99 of each stream's first event, counted from
# the moment the batch started; p99 and max of each stream's worst gap
# between two reads that brought events, and p99 of the same gap as the app
# wrote the events (support/stream_gaps.rb); the most streams open at once; the
# server's peak RSS less its RSS before, per stream open at that peak; its
# CPU (user + sys, its whole session) per event received; its most threads;
# the machine's listen drops; the client's CPU. With --runs N, every cell is
# measured N times, interleaved (round by round, so that a slow minute of a
# shared machine spreads over the servers), and its row is the worst run's
# (the latest first-event p99), with every run's first-event and worst-gap
# p99 beside it.
#
#   bench/run streams                      -> bench/results/streams.{txt,csv,svg}
#   bench/run streams --quick              smoke run: 200 streams of 10 events
#   bench/run --ruby 3.4-yjit streams      -> bench/results/ruby34-yjit/
#   bench/run streams --parts direct --streams 2000 --only neverblock,falcon --neverblock-args "--no-adaptive-limit"
#   bench/run --ruby 3.4-yjit streams --parts live,rails-body --streams 2000 --only neverblock,falcon --runs 3

require_relative "support/harness"
require_relative "support/stream_client"
require "neverblock/version"
require "net/http"

module NeverBlockBench
  class StreamsBench < Bench
    DEFAULTS = { streams: [500, 2000, 10_000], events: 40, interval_ms: 50, deadline: 60, clients: 2,
                 parts: %w[direct relay live rails-body], neverblock_args: "", runs: 1 }.freeze
    QUICK = { streams: [200], events: 10, deadline: 20, runs: 1 }.freeze
    ONLY = %w[neverblock neverblock-marked falcon puma-5 puma-50].freeze # the servers
    PARTS = %w[direct relay live rails-body].freeze
    RAILS_PARTS = %w[live rails-body].freeze # served by LIVE_APP
    APP = File.expand_path("support/streams_app.ru", __dir__)
    LIVE_APP = File.expand_path("support/streams_live.ru", __dir__) # the live part's Rails app
    WARM_UP = 20 # streams of 3 events 10 ms apart on each fresh server before the batch
    # Puma also corks the socket while it writes a response (TCP_CORK): a stream's events leave in ~200 ms batches.
    CHARTED = ["first p99 ms", "gap p99 ms", "RSS KB/open stream", "CPU us/event"].freeze # the chart's columns
    PUMA_MOST = 2000 # streams: past this Puma's cells only wait out --deadline
    NOTES = { "puma-5" => "5 threads: 5 streams at a time, corked", "puma-50" => "50 threads: 50 streams at a time, corked" }.freeze
    RUNS_COLUMNS = ["runs", "first p99 ms, runs", "gap p99 ms, runs"].freeze # with --runs 2 or more
    COLUMNS = ["part", "streams", "server", "complete", "first p50 ms", "first p99 ms", "gap p99 ms", "gap max ms", "app gap p99 ms",
               "upstream gap p99 ms",
               "peak open", "RSS KB/open stream", "CPU us/event", "threads", "listen drops", "RSS before MB", "seconds", "client CPU s",
               *RUNS_COLUMNS, "note"].freeze

    # @return [Boolean] true when every cell ran (whether its streams completed or not)
    def call
      parts = CommandLine.only(@options[:parts], PARTS)
      # The relay part: a server holds two sockets per stream, the upstream one.
      Machine.raise_fd_limit((@options[:streams].max * 2) + 1000)
      Peers.use_epoll
      puts header(parts)
      cells = parts.product(@options[:streams], @options[:only])
      runs = Array.new(@options[:runs]) do |round|
        warn "round #{round + 1} of #{@options[:runs]}" if @options[:runs] > 1
        cells.map { |part, count, server| not_run(part, count, server) || measure(part, count, server) }
      end
      rows = runs.transpose.map { |cell_runs| worst_of(cell_runs) }
      report(rows, parts)
      runs.flatten.none? { |row| row["note"].to_s.start_with?("failed") }
    end

    private

    # The row of a cell this bench does not run, with why; nil for one it runs.
    def not_run(part, count, server)
      why = if server.start_with?("puma") && count > PUMA_MOST
              "not run past #{PUMA_MOST} streams: a stream holds a thread"
            elsif RAILS_PARTS.include?(part) && server == "neverblock-marked"
              "not run: a Live stream is an event stream, which gives its slot back anyway"
            end
      why && { "part" => part, "streams" => count, "server" => server, **CHARTED.to_h { |column| [column, "not run"] }, "note" => why }
    end

    # A cell's row over its runs: the worst run's (a failed one, else the
    # latest first-event p99; "> N s" is later than any number), with every
    # run's first-event and worst-gap p99, in the order they ran.
    def worst_of(cell_runs)
      return cell_runs.first if cell_runs.size == 1 || cell_runs.first["note"].to_s.start_with?("not run")

      late = ->(value) { value.is_a?(Numeric) ? value : Float::INFINITY }
      worst = cell_runs.max_by do |row|
        [row["note"].to_s.start_with?("failed") ? 1 : 0, late.call(row["first p99 ms"]), late.call(row["gap p99 ms"])]
      end
      listed = ->(key) { cell_runs.map { |row| row[key] || "-" }.join(" ") }
      worst.merge("runs" => cell_runs.size, "first p99 ms, runs" => listed.call("first p99 ms"),
                  "gap p99 ms, runs" => listed.call("gap p99 ms"))
    end

    def header(parts)
      v = PeerServers.locked_versions
      extra = @options[:neverblock_args].empty? ? "" : " #{@options[:neverblock_args]}"
      NeverBlockBench.header(
        "# Streams opened at once: #{@options[:streams].join(', ')} per server process (#{parts.join(', ')})",
        "#{Checkout.description}; RLIMIT_NOFILE #{Process.getrlimit(:NOFILE).first}",
        "NeverBlock #{NeverBlock::VERSION} (neverblock serve -w 0#{extra}; fiber_pool 1000 and the adaptive limit unless " \
        "that says otherwise; -marked: each stream calls env[\"neverblock.mark_as_io_bound\"]); Falcon #{v['falcon']} " \
        "(async #{v['async']}, --count 1); Puma #{v['puma']} (single mode, --threads 5:5 and 50:50)",
        <<~TEXT.chomp
          A stream: GET, text/event-stream, #{@options[:events]} events #{@options[:interval_ms]} ms apart (a Rack body's each);
          relay: the same read from a fake LLM upstream (NeverBlock -w 0, its own process, not counted) with Net::HTTP read_body;
          live: the same written by a Rails app's ActionController::Live action (response.stream.write, then close);
          rails-body: the same Rails app's action returning them as a Rack body (self.response_body = an each).
          Client: #{@options[:clients]} forked Ruby processes (NeverBlock loops, a task per stream) open all streams at once; a
          stream is complete with all its events and the server's close within #{@options[:deadline]} s of the start.
          first: the first event's arrival after the start; gap: a stream's worst gap between reads that brought events;
          app gap: the same gap as the app wrote the events (relayed: read them), in the server's process, without the client's turns;
          upstream gap (relay): the same in the fake LLM, as it wrote the events the relaying server read;
          peak open: the most streams open at once (each from its first event to its last); RSS: the server session's peak
          (VmHWM) less its RSS before, per stream open at the peak; CPU: the session's user+sys per event received;
          listen drops: connections the machine's listening sockets dropped meanwhile (a full accept queue; TcpExt ListenDrops).
        TEXT
      )
    end

    def start(server, part, name: server)
      app = RAILS_PARTS.include?(part) ? LIVE_APP : APP
      case server
      when "neverblock", "neverblock-marked"
        PeerServers.neverblock(app, args: ["-w", "0", *@options[:neverblock_args].split], name: name)
      when "falcon" then PeerServers.falcon(app)
      else PeerServers.puma(app, threads: server.sub("puma-", "").then { |n| "#{n}:#{n}" }, name: server)
      end
    end

    # GET path of a stream of `events` under `server`, relayed from `upstream` (a port) if given;
    # the Rails app's Rack body for the rails-body part.
    def path(server, events:, interval_ms:, upstream: nil, part: nil)
      query = "events=#{events}&interval_ms=#{interval_ms}"
      query += "&marked=1" if server == "neverblock-marked"
      return "/body?#{query}" if part == "rails-body"

      upstream ? "/relay?#{query}&upstream=#{upstream}" : "/stream?#{query}"
    end

    # Starts the server (and for relay, the upstream), measures one batch, stops them. @return [Hash] the CSV row
    def measure(part, count, server)
      warn "#{part}, #{count} streams: #{server}"
      upstream = start_upstream if part == "relay"
      start(server, part).serve do |process|
        PeerServers.check_ruby(process)
        warm_up(process.port, server, upstream&.port, part)
        app_gaps(process.port) # the warm-up's, forgotten
        app_gaps(upstream.port) if upstream
        sample = ServerSample.new(process.pid)
        client = StreamClient.new(process.port, path(server, events: @options[:events], interval_ms: @options[:interval_ms],
                                                           upstream: upstream&.port, part: part),
                                  count, processes: @options[:clients], deadline: @options[:deadline])
        result = client.run { sample.take }
        row(part, count, server, result, sample.finish).merge("app gap p99 ms" => app_gaps(process.port)&.first,
                                                              "upstream gap p99 ms" => (app_gaps(upstream.port)&.first if upstream))
      ensure
        client&.kill
      end
    rescue StandardError => e
      warn "  #{server} failed: #{e.class}: #{e.message}"
      { "part" => part, "streams" => count, "server" => server, "note" => "failed: #{e.class}: #{e.message.lines.first&.strip}" }
    ensure
      upstream&.stop
    end

    # The fake LLM upstream of the relay part: NeverBlock, one process, its streams marked IO-bound (see the app).
    def start_upstream
      PeerServers.neverblock(APP, name: "upstream").tap(&:wait_until_ready)
    end

    # @return [Array(Integer, Integer), nil] p99 and max ms of the streams' worst gaps as the app wrote
    #   them since the last call (support/stream_gaps.rb), nil if the server could not say
    def app_gaps(port)
      text = Net::HTTP.start("127.0.0.1", port, open_timeout: 10, read_timeout: 30) { |http| http.get("/stream-gaps").body }
      p99, max, = text.split.map { |value| Integer(value, exception: false) }
      [p99, max] if p99
    rescue StandardError
      nil
    end

    # A few short streams on the fresh server, so that the batch does not pay for its first requests.
    def warm_up(port, server, upstream, part)
      client = StreamClient.new(port, path(server, events: 3, interval_ms: 10, upstream: upstream, part: part), WARM_UP,
                                processes: 1, deadline: 30)
      streams = client.run.streams
      done = streams.count { |stream| stream.events == 3 && stream.error.nil? }
      why = streams.filter_map(&:error).first&.then { |error| " (#{error})" }
      raise "#{WARM_UP - done} of #{WARM_UP} warm-up streams did not complete#{why}" unless done == WARM_UP
    ensure
      client&.kill
    end

    def row(part, count, server, result, server_numbers)
      streams = result.streams
      complete = streams.count { |stream| stream.error.nil? && stream.events == @options[:events] }
      received = streams.sum(&:events)
      firsts = streams.map { |stream| stream.first || Float::INFINITY }
      gaps = streams.select { |stream| stream.events > 1 }.map(&:worst_gap)
      ms = lambda do |seconds| # a stream with no first event by the deadline counts as infinitely late
        next if seconds.nil?

        seconds.finite? ? (seconds * 1000).round : "> #{@options[:deadline]} s"
      end
      shown = ->(seconds) { ms.call(seconds).then { |value| value.is_a?(Integer) ? "#{value} ms" : value.to_s } }
      warn format("  %d/%d complete, first event p99 %s, worst gap p99 %s, %.1f s", complete, count,
                  shown.call(NeverBlockBench.percentile(firsts, 0.99)), shown.call(NeverBlockBench.percentile(gaps, 0.99)), result.seconds)
      { "part" => part, "streams" => count, "server" => server, "complete" => "#{complete}/#{count}",
        "first p50 ms" => ms.call(NeverBlockBench.percentile(firsts, 0.5)), "first p99 ms" => ms.call(NeverBlockBench.percentile(firsts, 0.99)),
        "gap p99 ms" => ms.call(NeverBlockBench.percentile(gaps, 0.99)), "gap max ms" => ms.call(gaps.max),
        "peak open" => (peak = StreamClient.peak_open(streams)),
        "RSS KB/open stream" => (server_numbers[:rss_growth_kb].fdiv(peak).round(1) if peak.positive?),
        "CPU us/event" => (received.positive? ? (server_numbers[:cpu] * 1e6 / received).round(1) : nil),
        "threads" => server_numbers[:threads], "listen drops" => server_numbers[:listen_drops], "RSS before MB" => (server_numbers[:rss_before_kb] / 1024.0).round(1),
        "seconds" => result.seconds.round(1), "client CPU s" => result.cpu.round(1), "events" => received,
        "complete count" => complete, "note" => note(server, streams) }
    end

    # What the cell's server cannot do, and the commonest reason streams were cut short.
    def note(server, streams)
      errors = streams.map do |stream|
        stream.error || ("the server ended it after #{stream.events} events" if stream.events < @options[:events])
      end.compact.tally
      error = errors.max_by { |_, n| n }&.then { |text, n| "#{n} streams: #{text}" }
      [NOTES[server], error].compact.join("; ").then { |text| text unless text.empty? }
    end

    def report(rows, parts)
      several = @options[:runs] > 1
      table = Table.of(rows, several ? COLUMNS : COLUMNS - RUNS_COLUMNS, left: %w[part server complete note] + RUNS_COLUMNS.drop(1))
      puts(several ? "\nthe worst of #{@options[:runs]} runs per cell (latest first-event p99)\n\n#{table}" : "\n#{table}")
      chart = NeverBlockBench.chart("Streams opened at once on one server process",
                                    "#{@options[:events]} events #{@options[:interval_ms]} ms apart each; by streams opened")
      parts.each do |part|
        where = { "part" => part }
        chart.pivot("#{part}: first event p99, ms (lower is better)", "first p99 ms", series: "server", by: "streams", where: where, log: true)
        chart.pivot("#{part}: worst gap p99, ms (lower is better)", "gap p99 ms", series: "server", by: "streams", where: where, log: true)
      end
      chart.pivot("#{parts.first}: RSS per open stream (at the peak), KB", "RSS KB/open stream", series: "server", by: "streams",
                  where: { "part" => parts.first }, log: true) # Puma's, over its few open streams, is ten times the others'
      chart.pivot("#{parts.first}: CPU per event, µs", "CPU us/event", series: "server", by: "streams", where: { "part" => parts.first })
      NeverBlockBench.write_results(@options[:out], "streams", rows, chart)
    end

    # A server session's threads, memory and CPU over a batch: created just
    # before it (its peak RSS reset to its RSS), {#take} while it runs.
    class ServerSample
      def initialize(session)
        @session = session
        # Linux >= 4.0: VmHWM starts again from VmRSS.
        ProcessCpu.in_session(session) { |dir, _| File.write("#{dir}/clear_refs", "5") rescue nil } # rubocop:disable Style/RescueModifier
        @rss_before = status_kb("VmRSS")
        @cpu = ProcessCpu.session_seconds(session)
        @drops = ServerSample.listen_drops
        @threads = 0
        take
      end

      # @return [Integer, nil] connections the machine's listening sockets dropped so far (TcpExt ListenDrops:
      #   a full accept queue; the client's SYN is retried after 1, 3, 7 s)
      def self.listen_drops
        names, values = File.readlines("/proc/net/netstat").select { |line| line.start_with?("TcpExt:") }.map(&:split)
        Integer(values[names.index("ListenDrops")])
      rescue SystemCallError, TypeError, ArgumentError
        nil
      end

      def take
        @threads = [@threads, status_kb("Threads")].max
      end

      # @return [Hash] :rss_growth_kb (peak less before), :rss_before_kb, :cpu (seconds), :threads (the most),
      #   :listen_drops (the machine's, over the batch)
      def finish
        take
        drops = ServerSample.listen_drops
        { rss_growth_kb: status_kb("VmHWM") - @rss_before, rss_before_kb: @rss_before,
          cpu: ProcessCpu.session_seconds(@session) - @cpu, threads: @threads, listen_drops: (drops - @drops if drops && @drops) }
      end

      private

      # A /proc/PID/status field (kB, or a count) summed over the session.
      def status_kb(field)
        ProcessCpu.in_session(@session) { |dir, _| File.read("#{dir}/status")[/^#{field}:\s+(\d+)/, 1].to_i }.sum
      end
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::StreamsBench, "streams") if $PROGRAM_NAME == __FILE__
