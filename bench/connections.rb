#!/usr/bin/env ruby
# frozen_string_literal: true

# What a held connection costs a server (issue 24, item 3): one process of
# NeverBlock (`neverblock serve -w 0`), Puma (single mode) and Falcon
# (--count 1) holds --connections client connections (10_000) while fresh
# requests on new connections are timed:
#
#   idle  each connection made one keep-alive GET / (hello world), then idles
#   sse   each connection is an open text/event-stream (GET /sse) that gets an
#         event every whole second, the same second for all (a broadcast);
#         Puma is left out: its 5 threads hold 5 streams
#
# and, without servers, what a task parked on a queue costs:
#
#   queue --tasks (100_000) tasks each waiting in Thread::Queue#pop: RSS and PSS
#         per task of raw fibers (Fiber.yield, no scheduler: the lower bound),
#         NeverBlock.spawn and Async tasks, each in a forked child
#
# For each server: RSS and PSS (VmRSS and /proc/PID/smaps_rollup, summed over
# its session) before and after the connections, per connection, and RSS
# less LazyFree (smaps_rollup's Rss minus LazyFree: pages freed with
# madvise(MADV_FREE), as Ruby frees fiber stacks, stay in RSS until the
# kernel needs the memory); its CPU per
# second while they are held (ms of CPU per second, its whole session, from
# /proc); p50/p99 of --fresh sequential GET / on new connections before they
# are opened and while they are held; and how many were still open at the end.
#
#   bench/run connections                   -> bench/results/connections.{txt,csv,svg}
#   bench/run connections --quick           smoke run: 300 connections, 1,000 tasks, 1 s windows
#   bench/run connections --only neverblock --parts idle --connections 5000
#
# The connections are opened and held by a forked child of this script (plain
# nonblocking sockets; for sse it reads the events), so the fresh requests'
# timing here shares no GVL with it. Idle timeouts are raised to an hour on
# every server, so none closes a connection while it is measured. Both soft
# RLIMIT_NOFILE limits (this script's, inherited by the servers and the
# holder) are raised towards --connections + 1000. A fiber stack is two memory
# mappings, so 100_000 parked tasks need vm.max_map_count above the default
# 65530: as root the script raises it, as bench/fibers.rb does, and leaves it raised.

require_relative "support/harness"
require_relative "support/servers"
require "neverblock/version"

module NeverBlockBench
  # Runs the held-connections benchmark and reports it. See the file comment.
  class ConnectionsBench < Bench
    DEFAULTS = { connections: 10_000, fresh: 1000, window: 10, settle: 2, tasks: 100_000, parts: %w[idle sse queue] }.freeze
    QUICK = { connections: 300, fresh: 50, window: 1, settle: 1, tasks: 1000 }.freeze
    ONLY = %w[neverblock puma falcon].freeze # the servers
    PARTS = %w[idle sse queue].freeze
    # Memory mappings per fiber (stack, guard page) and what a process has besides (see bench/fibers.rb).
    MAP_COUNT = ->(fibers) { (fibers * 2) + 10_000 }
    # Connections opened at once (connect, write, then read every reply): below
    # every server's listen backlog, so no SYN is dropped and retried a second later.
    BATCH = 100
    IDLE_TIMEOUT = 3600 # seconds, every server's keep-alive timeout here
    # The parts' servers that cannot hold its connections, and why.
    CANNOT = { "sse" => { "puma" => "cannot hold them (5 threads: a stream holds one)" } }.freeze

    # Every server's app: hello world, and an event stream ticking each whole second.
    APP = <<~RUBY
      # frozen_string_literal: true

      # A text/event-stream body: an event at every whole second (a broadcast
      # all streams get at once) until the client goes away.
      class Ticks
        def each
          tick = Process.clock_gettime(Process::CLOCK_REALTIME).floor
          loop do
            tick += 1
            # A timer may fire a little early: sleep again until the second is here.
            while (left = tick - Process.clock_gettime(Process::CLOCK_REALTIME)).positive?
              sleep(left)
            end
            yield "data: tick\\n\\n"
          end
        end
      end

      HELLO = [200, { "content-type" => "text/plain", "content-length" => "12" }.freeze, ["Hello world\\n"].freeze].freeze

      run(lambda do |env|
        next HELLO unless env["PATH_INFO"] == "/sse"

        # NeverBlock: a stream only waits, so it gives its request slot back
        # (without this, --fiber-pool, 1000, streams at most).
        env["neverblock.mark_as_io_bound"]&.call
        [200, { "content-type" => "text/event-stream", "cache-control" => "no-cache" }, Ticks.new]
      end)
    RUBY

    # @return [Boolean] true when every server held every connection it was given
    def call
      parts = CommandLine.only(@options[:parts], PARTS)
      Machine.raise_fd_limit(@options[:connections] + 1000)
      Peers.use_epoll
      @scratch = Dir.mktmpdir("neverblock-bench-connections-")
      File.write(app_path, APP)
      File.write(File.join(@scratch, "neverblock.rb"), "limits idle_timeout: #{IDLE_TIMEOUT}\n")
      File.write(File.join(@scratch, "puma.rb"), "persistent_timeout #{IDLE_TIMEOUT}\n")
      puts header(parts)
      queue_ok = parts.include?("queue") ? QueueParking.new(@options).call : true
      rows = (parts - ["queue"]).product(@options[:only]).map do |part, server|
        CANNOT.dig(part, server)&.then { |note| { "part" => part, "server" => server, "note" => note } } || measure(part, server)
      end
      report(rows) unless rows.empty?
      queue_ok && rows.all? { |row| row["note"]&.start_with?("cannot") || row["open at end"] == "#{@options[:connections]}/#{@options[:connections]}" }
    ensure
      ServerProcess.stop_all
      FileUtils.rm_rf(@scratch) if @scratch
    end

    private

    def app_path = File.join(@scratch, "config.ru")

    # @return [ServerProcess] `server` serving the app on `port`
    def start(server, port)
      case server
      when "neverblock" then PeerServers.neverblock(app_path, port: port, args: ["-w", "0", "-C", File.join(@scratch, "neverblock.rb")])
      when "puma" then PeerServers.puma(app_path, port: port, config: File.join(@scratch, "puma.rb"))
      else PeerServers.peer("falcon", %W[bundle exec falcon serve --bind http://127.0.0.1:#{port} --count 1
                                          --timeout #{IDLE_TIMEOUT} --config #{app_path}], port, { "RACK_ENV" => "production" })
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

    # Starts the server, measures one part, stops the server.
    # @return [Hash] the CSV row
    def measure(part, server)
      warn "#{part}: #{server}"
      port = ServerProcess.free_port
      process = start(server, port)
      process.wait_until_ready
      fresh_requests(port, 200) # warm-up
      before = fresh_requests(port, @options[:fresh])
      rss_before, pss_before, used_before = memory_kb(process.pid)
      holder = Holder.start(port, @options[:connections], sse: part == "sse")
      sleep @options[:settle]
      rss_after, pss_after, used_after = memory_kb(process.pid)
      cpu = ProcessCpu.session_seconds(process.pid)
      sleep @options[:window]
      cpu = (ProcessCpu.session_seconds(process.pid) - cpu) / @options[:window]
      during = fresh_requests(port, @options[:fresh])
      held = holder.finish
      each = ->(kb) { format("%.1f", kb.to_f / holder.opened) if holder.opened.positive? }
      ms = ->(samples, fraction) { format("%.2f", samples.sort[((samples.size - 1) * fraction).round] * 1000) }
      warn "  #{holder.opened} opened, #{held[:open]} open at the end; RSS #{each.call(rss_after - rss_before)} KB each"
      { "part" => part, "server" => server, "open at end" => "#{held[:open]}/#{@options[:connections]}",
        "RSS before MB" => format("%.1f", rss_before / 1024.0), "RSS KB/conn" => each.call(rss_after - rss_before),
        "PSS KB/conn" => each.call(pss_after - pss_before), "RSS-LazyFree KB/conn" => each.call(used_after - used_before),
        "CPU ms/s held" => format("%.1f", cpu * 1000),
        "fresh p50 ms before" => ms.call(before, 0.5), "fresh p99 ms before" => ms.call(before, 0.99),
        "fresh p50 ms held" => ms.call(during, 0.5), "fresh p99 ms held" => ms.call(during, 0.99),
        "events/s" => (held[:events_per_second]&.round if part == "sse"), "note" => held[:failure] }
    rescue StandardError => e
      warn "  #{server} failed: #{e.class}: #{e.message}"
      { "part" => part, "server" => server, "note" => "#{e.class}: #{e.message.lines.first&.strip}" }
    ensure
      holder&.kill
      process&.stop
    end

    # @return [Array(Integer, Integer, Integer)] VmRSS, Pss and Rss minus
    #   LazyFree in kB, summed over the session's processes
    def memory_kb(session)
      Dir.glob("/proc/[0-9]*/stat").filter_map do |path|
        stat = File.read(path)
        next unless Integer(stat[(stat.rindex(")") + 2)..].split[3]) == session

        dir = File.dirname(path)
        rollup = File.read("#{dir}/smaps_rollup")
        [File.read("#{dir}/status")[/^VmRSS:\s+(\d+)/, 1].to_i, rollup[/^Pss:\s+(\d+)/, 1].to_i,
         rollup[/^Rss:\s+(\d+)/, 1].to_i - rollup[/^LazyFree:\s+(\d+)/, 1].to_i]
      rescue SystemCallError
        nil
      end.transpose.map(&:sum)
    end

    # Times `count` sequential GET / each on a new connection.
    # @return [Array<Float>] seconds
    def fresh_requests(port, count)
      Array.new(count) do
        NeverBlockBench.timed do
          Socket.tcp("127.0.0.1", port) do |socket|
            socket.write("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            HTTP.read_response(socket, NeverBlockBench.now + 10) or raise "no response to a fresh GET /"
          end
        end
      end
    end

    COLUMNS = ["part", "server", "open at end", "RSS before MB", "RSS KB/conn", "PSS KB/conn", "RSS-LazyFree KB/conn", "CPU ms/s held", "fresh p50 ms before",
               "fresh p99 ms before", "fresh p50 ms held", "fresh p99 ms held", "events/s", "note"].freeze

    def report(rows)
      rows = rows.map { |row| COLUMNS.to_h { |column| [column, row[column]] } }
      puts "\n#{Table.new(COLUMNS, rows.map(&:values), align: %i[left left] + [:right] * 11 + [:left])}"
      chart = NeverBlockBench.chart("#{@options[:connections]} held connections, one server process each")
      chart.pivot("RSS per connection (KB)", "RSS KB/conn", series: "server", by: "part")
      chart.pivot("PSS per connection (KB)", "PSS KB/conn", series: "server", by: "part")
      chart.pivot("RSS less LazyFree per connection (KB)", "RSS-LazyFree KB/conn", series: "server", by: "part")
      chart.pivot("fresh requests while held, p99 (ms)", "fresh p99 ms held", series: "server", by: "part")
      chart.pivot("CPU while held (ms per second)", "CPU ms/s held", series: "server", by: "part")
      NeverBlockBench.write_results(@options[:out], "connections", rows, chart)
    end

    module HTTP
      module_function

      # Reads one response (Content-Length or chunked framing).
      # @return [String, nil] its head, nil on EOF or past `deadline`
      def read_response(socket, deadline)
        data = +"".b
        until (head_end = data.index("\r\n\r\n"))
          chunk = read_some(socket, deadline) or return nil
          data << chunk
        end
        head = data[0, head_end]
        body = data[(head_end + 4)..]
        if (length = head[/^content-length:\s*(\d+)/i, 1])
          body << (read_some(socket, deadline) || (return nil)) while body.bytesize < length.to_i
        elsif head.match?(/^transfer-encoding:\s*chunked/i)
          body << (read_some(socket, deadline) || (return nil)) until body.end_with?("0\r\n\r\n")
        end
        head
      end

      def read_some(socket, deadline)
        loop do
          data = socket.read_nonblock(16_384, exception: false)
          return data unless data == :wait_readable

          remaining = deadline - NeverBlockBench.now
          return nil unless remaining.positive? && socket.wait_readable(remaining)
        end
      end
    end

    # A forked child that opens and holds the connections (see the file
    # comment), reading stream events for sse, and tells what it saw.
    class Holder
      # @return [Integer] connections opened (each answered once)
      attr_reader :opened

      # Forks the holder and waits until it opened every connection.
      # @return [Holder]
      def self.start(port, count, sse:)
        new(port, count, sse).tap(&:wait_opened)
      end

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
        split = NeverBlockBench.split(count, (count + BATCH - 1) / BATCH)
        split.each { |batch| sockets.concat(open_batch(port, batch, sse)) }
        to_parent.puts("opened #{sockets.size}")
        # Events sent while the later streams were opened are not counted.
        sockets.each { |socket| drain(socket) } if sse
        started = NeverBlockBench.now
        events = 0
        until from_parent.wait_readable(sse ? 0.2 : 1)
          events += sockets.sum { |socket| drain(socket) } if sse
        end
        seconds = NeverBlockBench.now - started
        to_parent.write(Marshal.dump({ open: sockets.count { |socket| open?(socket, sse) },
                                       events_per_second: events / seconds }))
      rescue StandardError => e
        to_parent.puts("failed #{e.class}: #{e.message}")
        to_parent.write(Marshal.dump({ open: 0, failure: "#{e.class}: #{e.message}" }))
      end

      def open_batch(port, size, sse)
        request = "GET #{sse ? '/sse' : '/'} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        sockets = Array.new(size) { Socket.tcp("127.0.0.1", port, connect_timeout: 10) }
        sockets.each { |socket| socket.write(request) }
        deadline = NeverBlockBench.now + 30
        sockets.each do |socket|
          if sse
            data = +"".b
            data << (HTTP.read_some(socket, deadline) || raise("no stream head")) until data.include?("\r\n\r\n")
          else
            HTTP.read_response(socket, deadline) or raise "no response on a connection being opened"
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

      # Whether the server still has the connection open: it answers a second
      # request (idle), or sent no end of stream (sse).
      def open?(socket, sse)
        return socket.read_nonblock(65_536, exception: false) != nil && !socket.closed? if sse

        socket.write("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        !HTTP.read_response(socket, NeverBlockBench.now + 10).nil?
      rescue SystemCallError, IOError
        false
      end
    end

    # The queue part: tasks parked on a Thread::Queue, memory per task (see the file comment).
    class QueueParking
      # `park.(count, parked)` starts `count` tasks that each pop `queue`, calls
      # `parked` once all wait, then feeds the queue and returns when all are done.
      Variant = Struct.new(:name, :label, :park, keyword_init: true)

      def initialize(options)
        @options = options
      end

      # @return [Boolean] true when every variant parked and woke every task
      def call
        count = @options[:tasks]
        Machine.raise_sysctl("vm/max_map_count", MAP_COUNT.call(count))
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

      def memory_kb
        [Machine.status_kb("VmRSS"), File.read("/proc/self/smaps_rollup")[/^Pss:\s+(\d+)/, 1].to_i]
      end

      def report(count, outcomes)
        rows = outcomes.map do |variant, outcome|
          failed = outcome.is_a?(Isolated::Failure)
          { "variant" => variant.name, "RSS KB/task" => (format("%.2f", outcome[:rss]) unless failed),
            "PSS KB/task" => (format("%.2f", outcome[:pss]) unless failed), "what" => failed ? "FAILED #{outcome}" : variant.label }
        end
        columns = ["variant", "RSS KB/task", "PSS KB/task", "what"]
        puts "\n## #{count} tasks parked on a Thread::Queue, memory per task (a forked child each)\n\n" \
             "vm.max_map_count #{Machine.sysctl('vm/max_map_count')}\n#{Table.new(columns, rows.map(&:values), align: %i[left right right left])}"
        chart = NeverBlockBench.chart("#{count} tasks parked on a Thread::Queue: memory per task")
        chart.pivot("RSS KB per parked task", "RSS KB/task", series: "variant")
        chart.pivot("PSS KB per parked task", "PSS KB/task", series: "variant")
        NeverBlockBench.write_results(@options[:out], "connections_queue", rows, chart)
      end
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::ConnectionsBench, "connections") if $PROGRAM_NAME == __FILE__
