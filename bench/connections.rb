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
require_relative "support/servers"
require "neverblock/version"

module NeverBlockBench
  class ConnectionsBench < Bench
    DEFAULTS = { connections: 10_000, fresh: 1000, window: 10, settle: 2, tasks: 100_000, parts: %w[idle sse queue] }.freeze
    QUICK = { connections: 300, fresh: 50, window: 1, settle: 1, tasks: 1000 }.freeze
    ONLY = %w[neverblock puma falcon].freeze # the servers
    PARTS = %w[idle sse queue].freeze
    APP = File.expand_path("support/connections_app.ru", __dir__)
    # Connections opened at once: below every server's listen backlog, so no SYN is dropped and retried.
    BATCH = 100
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

    def config(name, text) = File.join(scratch, name).tap { |path| File.write(path, "#{text}\n") }

    def start(server)
      case server
      when "neverblock" then PeerServers.neverblock(APP, args: ["-w", "0", "-C", config("neverblock.rb", "limits idle_timeout: #{IDLE_TIMEOUT}")])
      when "puma" then PeerServers.puma(APP, config: config("puma.rb", "persistent_timeout #{IDLE_TIMEOUT}"))
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
        before = fresh_requests(process.port, @options[:fresh])
        rss_before, pss_before, used_before = memory_kb(process.pid)
        holder = Holder.start(process.port, @options[:connections], sse: part == "sse")
        sleep @options[:settle]
        rss_after, pss_after, used_after = memory_kb(process.pid)
        cpu = ProcessCpu.session_seconds(process.pid)
        sleep @options[:window]
        cpu = (ProcessCpu.session_seconds(process.pid) - cpu) / @options[:window]
        during = fresh_requests(process.port, @options[:fresh])
        held = holder.finish
        each = ->(kb) { format("%.1f", kb.to_f / holder.opened) if holder.opened.positive? }
        ms = ->(samples, fraction) { format("%.2f", NeverBlockBench.percentile(samples, fraction) * 1000) }
        warn "  #{holder.opened} opened, #{held[:open]} open at the end; RSS #{each.call(rss_after - rss_before)} KB each"
        { "part" => part, "server" => server, "open at end" => "#{held[:open]}/#{@options[:connections]}",
          "RSS before MB" => format("%.1f", rss_before / 1024.0), "RSS KB/conn" => each.call(rss_after - rss_before),
          "PSS KB/conn" => each.call(pss_after - pss_before), "RSS-LazyFree KB/conn" => each.call(used_after - used_before),
          "CPU ms/s held" => format("%.1f", cpu * 1000),
          "fresh p50 ms before" => ms.call(before, 0.5), "fresh p99 ms before" => ms.call(before, 0.99),
          "fresh p50 ms held" => ms.call(during, 0.5), "fresh p99 ms held" => ms.call(during, 0.99),
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

    # A forked child that opens and holds the connections, reading stream
    # events for sse, and tells what it saw.
    class Holder
      attr_reader :opened # connections opened (each answered once)

      # Forks the holder and waits until it opened every connection.
      def self.start(port, count, sse:) = new(port, count, sse).tap(&:wait_opened)

      def initialize(port, count, sse)
        @from_child, to_parent = IO.pipe
        from_parent, @to_child = IO.pipe
        @pid = fork do
          @from_child.close
          @to_child.close
          hold(port, count, sse, from_parent, to_parent)
          exit!(0)
        end
        to_parent.close
        from_parent.close
      end

      def wait_opened
        line = @from_child.gets or raise "the connection holder died while opening"
        @opened = Integer(line[/\Aopened (\d+)/, 1] || raise("the holder failed: #{line.strip}"))
      end

      # Ends the holding: the child checks every connection, closes them and reports.
      # @return [Hash] :open (connections the server still had open), :events_per_second, :failure
      def finish
        @to_child.write("finish\n")
        report = Marshal.load(@from_child.read) # rubocop:disable Security/MarshalLoad -- our own child
        Process.wait(@pid)
        @pid = nil
        report
      end

      def kill
        return unless @pid

        Process.kill("KILL", @pid)
        Process.wait(@pid)
      rescue Errno::ESRCH, Errno::ECHILD
        nil
      ensure
        @pid = nil
      end

      private

      def hold(port, count, sse, from_parent, to_parent)
        sockets = []
        NeverBlockBench.split(count, (count + BATCH - 1) / BATCH).each { |batch| sockets.concat(open_batch(port, batch, sse)) }
        to_parent.puts("opened #{sockets.size}")
        sockets.each { |socket| drain(socket) } if sse # events sent while the later streams were opened do not count
        started = NeverBlockBench.now
        events = 0
        until from_parent.wait_readable(sse ? 0.2 : 1)
          events += sockets.sum { |socket| drain(socket) } if sse
        end
        seconds = NeverBlockBench.now - started
        to_parent.write(Marshal.dump({ open: sockets.count { |socket| open?(socket, sse) }, events_per_second: events / seconds }))
      rescue StandardError => e
        to_parent.puts("failed #{e.class}: #{e.message}")
        to_parent.write(Marshal.dump({ open: 0, failure: "#{e.class}: #{e.message}" }))
      end

      def open_batch(port, size, sse)
        sockets = Array.new(size) { Socket.tcp("127.0.0.1", port, connect_timeout: 10) }
        sockets.each { |socket| socket.write(RawHTTP.request(sse ? "/sse" : "/")) }
        deadline = NeverBlockBench.now + 30
        sockets.each do |socket|
          if sse
            data = +"".b
            data << (RawHTTP.read_some(socket, deadline) || raise("no stream head")) until data.include?("\r\n\r\n")
          else
            RawHTTP.read_response(socket, deadline) or raise "no response on a connection being opened"
          end
        end
      end

      # @return [Integer] events read from a stream now
      def drain(socket)
        events = 0
        while (data = socket.read_nonblock(65_536, exception: false)).is_a?(String)
          events += data.scan("data: tick").size
        end
        events
      end

      # Whether the server still has the connection open: it answers a second request (idle), or sent no end of stream (sse).
      def open?(socket, sse)
        return socket.read_nonblock(65_536, exception: false) != nil && !socket.closed? if sse

        socket.write(RawHTTP.request)
        !RawHTTP.read_response(socket, NeverBlockBench.now + 10).nil?
      rescue SystemCallError, IOError
        false
      end
    end

    # The queue part: memory per task parked on a Thread::Queue, each variant in a forked child.
    class QueueParking
      # `park.(count, parked)` starts `count` tasks that each pop a queue, calls
      # `parked` once all wait, then feeds the queue and returns when all are done.
      Variant = Struct.new(:name, :label, :park, keyword_init: true)

      def initialize(options)
        @options = options
      end

      # @return [Boolean] true when every variant parked and woke every task
      def call
        count = @options[:tasks]
        # A fiber stack is two memory mappings: 100_000 parked tasks need more than the default 65530.
        Machine.raise_sysctl("vm/max_map_count", (count * 2) + 10_000)
        rows = variants.map do |variant|
          outcome = Isolated.run(timeout: 300) { measure(variant, count) }
          warn "queue: #{variant.name}: #{outcome.is_a?(Isolated::Failure) ? "FAILED #{outcome}" : format('%.2f KB/task', outcome[:rss])}"
          [variant, outcome]
        end
        report(count, rows)
        rows.none? { |_, outcome| outcome.is_a?(Isolated::Failure) }
      end

      private

      def variants
        queue_pop = ->(queue) { queue.pop }
        [Variant.new(name: "fibers", label: "raw Fiber.new { Fiber.yield }, no scheduler (the lower bound)",
                     park: lambda do |count, parked|
                       fibers = Array.new(count) { Fiber.new { Fiber.yield }.tap(&:resume) }
                       parked.call
                       fibers.each(&:resume)
                     end),
         Variant.new(name: "neverblock", label: "NeverBlock.spawn { queue.pop }",
                     park: lambda do |count, parked|
                       require "neverblock"
                       NeverBlock.run do
                         queue = Thread::Queue.new
                         tasks = Array.new(count) { NeverBlock.spawn { queue_pop.call(queue) } }
                         NeverBlock.sleep(0.01) until queue.num_waiting == count
                         parked.call
                         count.times { queue << 1 }
                         NeverBlock.wait_all(tasks)
                       end
                     end),
         Variant.new(name: "async", label: "Async { queue.pop } (async #{Machine.gem_version('async')})",
                     park: lambda do |count, parked|
                       require "async"
                       Async do |task|
                         queue = Thread::Queue.new
                         tasks = Array.new(count) { task.async { queue_pop.call(queue) } }
                         sleep(0.01) until queue.num_waiting == count
                         parked.call
                         count.times { queue << 1 }
                         tasks.each(&:wait)
                       end.wait
                     end)]
      end

      # In a forked child: memory before and with `count` tasks parked, per task (KB).
      def measure(variant, count)
        GC.start
        before = memory_kb
        after = nil
        variant.park.call(count, -> { GC.start; after = memory_kb })
        { rss: (after[0] - before[0]).to_f / count, pss: (after[1] - before[1]).to_f / count }
      end

      def memory_kb = [Machine.status_kb("VmRSS"), File.read("/proc/self/smaps_rollup")[/^Pss:\s+(\d+)/, 1].to_i]

      def report(count, outcomes)
        rows = outcomes.map do |variant, outcome|
          failed = outcome.is_a?(Isolated::Failure)
          { "variant" => variant.name, "RSS KB/task" => (format("%.2f", outcome[:rss]) unless failed),
            "PSS KB/task" => (format("%.2f", outcome[:pss]) unless failed), "what" => failed ? "FAILED #{outcome}" : variant.label }
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
