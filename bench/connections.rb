#!/usr/bin/env ruby
# frozen_string_literal: true

# What a held connection costs a server: one process of NeverBlock
# (`neverblock serve -w 0`), Puma (single mode) and Falcon (--count 1) holds
# --connections connections, idle after one GET / (idle) or each an open
# event stream ticking every second (sse; not Puma, whose 5 threads hold 5):
# RSS, PSS and RSS less LazyFree (fiber stacks freed with MADV_FREE stay in
# RSS until needed) of its session per connection, its CPU while they are
# held, p50/p99 of --fresh GET / on new connections before and meanwhile.
# A forked child holds the connections. The queue part, without servers: the
# memory per task of --tasks tasks parked on a Thread::Queue.
#
#   bench/run connections                   -> bench/results/connections.{txt,csv,svg}
#   bench/run connections --quick           smoke run: 300 connections, 1,000 tasks, 1 s windows
#   bench/run connections --only neverblock --parts idle --connections 5000

require_relative "support/harness"
require_relative "support/connection_holder"
require "neverblock/version"

module NeverBlockBench
  class ConnectionsBench < Bench
    DEFAULTS = { connections: 10_000, fresh: 1000, window: 10, settle: 2, tasks: 100_000, parts: %w[idle sse queue] }.freeze
    QUICK = { connections: 300, fresh: 50, window: 1, settle: 1, tasks: 1000 }.freeze
    ONLY = %w[neverblock puma falcon].freeze # the servers
    PARTS = %w[idle sse queue].freeze
    APP = File.expand_path("support/connections_app.ru", __dir__)
    IDLE_TIMEOUT = 3600 # seconds, every server's keep-alive timeout here
    CANNOT = { "sse" => { "puma" => "cannot hold them (5 threads: a stream holds one)" } }.freeze
    COLUMNS = ["part", "server", "open at end", "RSS before MB", "RSS KB/conn", "PSS KB/conn", "RSS-LazyFree KB/conn", "CPU ms/s held",
               "fresh p50 ms before", "fresh p99 ms before", "fresh p50 ms held", "fresh p99 ms held", "events/s", "note"].freeze

    # @return [Boolean] true when every server held every connection it was given
    def call
      parts = CommandLine.only(@options[:parts], PARTS)
      Machine.raise_fd_limit(@options[:connections] + 1000)
      Peers.use_epoll
      puts header(parts)
      queue_ok = parts.include?("queue") ? QueueParking.new(@options).call : true
      rows = (parts - ["queue"]).product(@options[:only]).map do |part, server|
        CANNOT.dig(part, server)&.then { |note| { "part" => part, "server" => server, "note" => note } } || measure(part, server)
      end
      report(rows) unless rows.empty?
      queue_ok && rows.all? { |row| row["note"]&.start_with?("cannot") || row["open at end"] == "#{@options[:connections]}/#{@options[:connections]}" }
    end

    private

    def start(server)
      case server
      when "neverblock"
        PeerServers.neverblock(APP, args: ["-w", "0", "-C", config_file("nb.rb", "limits idle_timeout: #{IDLE_TIMEOUT}")])
      when "puma" then PeerServers.puma(APP, config: config_file("puma.rb", "persistent_timeout #{IDLE_TIMEOUT}"))
      else PeerServers.falcon(APP, args: %W[--timeout #{IDLE_TIMEOUT}])
      end
    end

    def header(parts)
      v = PeerServers.locked_versions
      title = parts == ["queue"] ? "# Parked tasks" : "# Held connections: #{@options[:connections]} per server, one process each"
      facts = ["#{Checkout.description}; RLIMIT_NOFILE #{Process.getrlimit(:NOFILE).first}"]
      unless parts == ["queue"]
        facts << "NeverBlock #{NeverBlock::VERSION} (neverblock serve -w 0, fiber_pool 1000); Puma #{v['puma']} (single mode, " \
                 "default threads 0:5); Falcon #{v['falcon']} (async #{v['async']}, --count 1, --timeout #{IDLE_TIMEOUT})"
        facts << <<~TEXT.chomp
          idle: one GET / per connection, then idle; sse: GET /sse, an event each whole second.
          Memory: VmRSS, smaps_rollup Pss and Rss less LazyFree of the server's session, #{@options[:settle]} s after the last connection,
          per connection over the count before; CPU: the session's user+sys over #{@options[:window]} s while held;
          fresh: #{@options[:fresh]} sequential GET / on new connections before and while held (after the CPU window).
        TEXT
      end
      NeverBlockBench.header(title, *facts)
    end

    # Starts the server, measures one part, stops the server. @return [Hash] the CSV row
    def measure(part, server)
      warn "#{part}: #{server}"
      start(server).serve do |process|
        fresh_requests(process.port, 200) # warm-up
        fresh = { "before" => fresh_requests(process.port, @options[:fresh]) }
        memory = memory_kb(process.pid)
        holder = ConnectionHolder.start(process.port, @options[:connections], sse: part == "sse")
        sleep @options[:settle]
        rss, pss, used = memory_kb(process.pid).zip(memory).map { |now, was| format("%.1f", (now - was).fdiv(holder.opened)) }
        cpu = ProcessCpu.session_seconds(process.pid)
        sleep @options[:window]
        cpu = (ProcessCpu.session_seconds(process.pid) - cpu) / @options[:window]
        fresh["held"] = fresh_requests(process.port, @options[:fresh])
        held = holder.finish
        warn "  #{holder.opened} opened, #{held[:open]} open at the end; RSS #{rss} KB each"
        ms = fresh.flat_map do |at, samples|
          [50, 99].map { |p| ["fresh p#{p} ms #{at}", format("%.2f", NeverBlockBench.percentile(samples, p / 100.0) * 1000)] }
        end
        { "part" => part, "server" => server, "open at end" => "#{held[:open]}/#{@options[:connections]}",
          "RSS before MB" => format("%.1f", memory[0] / 1024.0), "RSS KB/conn" => rss, "PSS KB/conn" => pss,
          "RSS-LazyFree KB/conn" => used, "CPU ms/s held" => format("%.1f", cpu * 1000), **ms.to_h,
          "events/s" => (held[:events_per_second]&.round if part == "sse"), "note" => held[:failure] }
      ensure
        holder&.kill
      end
    rescue StandardError => e
      warn "  #{server} failed: #{e.class}: #{e.message}"
      { "part" => part, "server" => server, "note" => "#{e.class}: #{e.message.lines.first&.strip}" }
    end

    # @return [Array(Integer, Integer, Integer)] VmRSS, Pss and Rss less LazyFree in kB, summed over the session
    def memory_kb(session)
      ProcessCpu.in_session(session) do |dir, _|
        rollup = File.read("#{dir}/smaps_rollup")
        [File.read("#{dir}/status")[/^VmRSS:\s+(\d+)/, 1].to_i, rollup[/^Pss:\s+(\d+)/, 1].to_i,
         rollup[/^Rss:\s+(\d+)/, 1].to_i - rollup[/^LazyFree:\s+(\d+)/, 1].to_i]
      end.transpose.map(&:sum)
    end

    # @return [Array<Float>] seconds of `count` sequential GET / each on a new connection
    def fresh_requests(port, count)
      Array.new(count) { NeverBlockBench.timed { RawHTTP.get(port) or raise "no response to a fresh GET /" } }
    end

    def report(rows)
      rows = rows.map { |row| COLUMNS.to_h { |column| [column, row[column]] } }
      puts "\n#{Table.of(rows, COLUMNS, left: %w[server note])}"
      chart = NeverBlockBench.chart("#{@options[:connections]} held connections, one server process each")
      { "RSS per connection (KB)" => "RSS KB/conn", "PSS per connection (KB)" => "PSS KB/conn",
        "RSS less LazyFree per connection (KB)" => "RSS-LazyFree KB/conn", "fresh requests while held, p99 (ms)" => "fresh p99 ms held",
        "CPU while held (ms per second)" => "CPU ms/s held" }.each { |title, column| chart.pivot(title, column, series: "server", by: "part") }
      NeverBlockBench.write_results(@options[:out], "connections", rows, chart)
    end

    # The queue part: memory per task parked on a Thread::Queue, each variant in a forked child.
    class QueueParking
      # name => [label, park]: `park.(count, parked)` starts `count` tasks that each pop a queue, calls
      # `parked` once all wait, then feeds the queue and returns when all are done.
      VARIANTS = {
        "fibers" => ["raw Fiber.new { Fiber.yield }, no scheduler (the lower bound)", lambda do |count, parked|
          fibers = Array.new(count) { Fiber.new { Fiber.yield }.tap(&:resume) }
          parked.call
          fibers.each(&:resume)
        end],
        "neverblock" => ["NeverBlock.spawn { queue.pop }", lambda do |count, parked|
          require "neverblock"
          NeverBlock.run { NeverBlock.wait_all(on_queue(count, parked, ->(pop) { NeverBlock.spawn(&pop) })) }
        end],
        "async" => ["Async { queue.pop } (async #{Machine.gem_version('async')})", lambda do |count, parked|
          require "async"
          Async { |task| on_queue(count, parked, ->(pop) { task.async(&pop) }).each(&:wait) }.wait
        end]
      }.freeze

      # Starts `count` tasks (`spawn.(block)` starts one) that pop one queue, calls `parked`
      # once all wait, feeds the queue. @return [Array] the tasks
      def self.on_queue(count, parked, spawn)
        queue = Thread::Queue.new
        tasks = Array.new(count) { spawn.call(proc { queue.pop }) }
        sleep(0.01) until queue.num_waiting == count
        parked.call
        count.times { queue << 1 }
        tasks
      end

      def initialize(options)
        @options = options
      end

      # @return [Boolean] true when every variant parked and woke every task
      def call
        count = @options[:tasks]
        # A fiber stack is two memory mappings: 100_000 parked tasks need more than the default 65530.
        Machine.raise_sysctl("vm/max_map_count", (count * 2) + 10_000)
        rows = VARIANTS.map do |name, (label, park)|
          outcome = Isolated.run(timeout: 300) { measure(park, count) }
          warn "queue: #{name}: #{outcome.is_a?(Isolated::Failure) ? "FAILED #{outcome}" : format('%.2f KB/task', outcome[:rss])}"
          [name, label, outcome]
        end
        report(count, rows)
        rows.none? { |*, outcome| outcome.is_a?(Isolated::Failure) }
      end

      private

      # In a forked child: memory before and with `count` tasks parked, per task (KB).
      def measure(park, count)
        GC.start
        before = memory_kb
        after = nil
        park.call(count, -> { GC.start; after = memory_kb })
        { rss: (after[0] - before[0]).to_f / count, pss: (after[1] - before[1]).to_f / count }
      end

      def memory_kb = [Machine.status_kb("VmRSS"), File.read("/proc/self/smaps_rollup")[/^Pss:\s+(\d+)/, 1].to_i]

      def report(count, outcomes)
        rows = outcomes.map do |name, label, outcome|
          failed = outcome.is_a?(Isolated::Failure)
          { "variant" => name, "RSS KB/task" => (format("%.2f", outcome[:rss]) unless failed),
            "PSS KB/task" => (format("%.2f", outcome[:pss]) unless failed), "what" => failed ? "FAILED #{outcome}" : label }
        end
        puts "\n## #{count} tasks parked on a Thread::Queue, memory per task (a forked child each)\n\n" \
             "vm.max_map_count #{Machine.sysctl('vm/max_map_count')}\n#{Table.of(rows, rows.first.keys, left: ['what'])}"
        chart = NeverBlockBench.chart("#{count} tasks parked on a Thread::Queue: memory per task")
        chart.pivot("RSS KB per parked task", "RSS KB/task", series: "variant")
        chart.pivot("PSS KB per parked task", "PSS KB/task", series: "variant")
        NeverBlockBench.write_results(@options[:out], "connections_queue", rows, chart)
      end
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::ConnectionsBench, "connections") if $PROGRAM_NAME == __FILE__
