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
# its session) before and after the connections, per connection; its CPU per
# second while they are held (ms of CPU per second, its whole session, from
# /proc); p50/p99 of --fresh sequential GET / on new connections before they
# are opened and while they are held; and how many were still open at the end.
#
#   bench/run connections                   -> bench/results/connections.{txt,csv,svg}
#   bench/run connections --quick           smoke run: 500 connections, 2 s windows
#   bench/run connections --only neverblock --parts idle --connections 5000
#   bench/run connections --parts queue --tasks 10_000
#   bench/run connections --only neverblock --neverblock /tmp/main --out /tmp/before
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
  class ConnectionsBench
    DEFAULTS = { connections: 10_000, fresh: 1000, window: 10, settle: 2, tasks: 100_000, parts: %w[idle sse queue],
                 out: RESULTS, selector: Peers::DEFAULT_SELECTOR }.freeze
    QUICK = { connections: 500, fresh: 100, window: 2, settle: 1, tasks: 2000 }.freeze
    PARTS = %w[idle sse queue].freeze
    # Memory mappings per fiber (stack, guard page) and what a process has besides (see bench/fibers.rb).
    MAPPINGS_PER_FIBER = 2
    MAPPINGS_BESIDES = 10_000
    # Connections opened at once (connect, write, then read every reply): below
    # every server's listen backlog, so no SYN is dropped and retried a second later.
    BATCH = 100
    IDLE_TIMEOUT = 3600 # seconds, every server's keep-alive timeout here

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

    # What one server holding one part's connections measured.
    Result = Struct.new(:part, :server, :held, :opened, :still_open, :rss_before, :rss_after, :pss_before, :pss_after,
                        :cpu_per_second, :fresh_before, :fresh_during, :events_per_second, :failure, keyword_init: true) do
      # @return [Float, nil] KB per connection
      def rss_each = opened&.positive? ? (rss_after - rss_before).to_f / opened : nil
      def pss_each = opened&.positive? ? (pss_after - pss_before).to_f / opened : nil
    end

    def initialize(options)
      @options = options
      @parts = CommandLine.parts(@options[:parts], PARTS)
      @servers = CommandLine.select(servers, @options[:only])
    end

    # @return [Boolean] true when every server held every connection it was given
    def call
      @fd_limit = Machine.raise_fd_limit(@options[:connections] + 1000)
      @selector = Peers.use_selector(@options[:selector])
      if (@parts - ["queue"]).any? && (@servers.map(&:name) & %w[puma falcon]).any? && (problem = PeerServers.problem)
        return warn(problem) && false
      end

      @scratch = Dir.mktmpdir("neverblock-bench-connections-")
      File.write(app_path, APP)
      File.write(File.join(@scratch, "neverblock.rb"), "limits idle_timeout: #{IDLE_TIMEOUT}\n")
      File.write(File.join(@scratch, "puma.rb"), "persistent_timeout #{IDLE_TIMEOUT}\n")
      puts header
      queue_ok = @parts.include?("queue") ? QueueParking.new(@options).call : true
      results = (@parts - ["queue"]).flat_map do |part|
        @servers.map do |server|
          next Result.new(part: part, server: server.name, failure: "cannot hold them (#{server.skip[part]})") if server.skip[part]

          measure(part, server)
        end
      end
      report(results) unless results.empty?
      queue_ok && results.all? { |result| result.failure&.start_with?("cannot") || (result.failure.nil? && result.still_open == result.held) }
    ensure
      ServerProcess.stop_all
      FileUtils.rm_rf(@scratch) if @scratch
    end

    private

    # `start` takes a port and returns a ServerProcess; `skip` names the parts it cannot run and why.
    Server = Struct.new(:name, :label, :start, :skip, keyword_init: true)

    def servers
      v = PeerServers.locked_versions
      repo = PeerServers::REPO
      [Server.new(name: "neverblock", skip: {},
                  label: "NeverBlock #{NeverBlock::VERSION} (neverblock serve -w 0, fiber_pool 1000#{", from #{@options[:neverblock]}" if @options[:neverblock]})",
                  start: lambda do |port|
                    ServerProcess.start("neverblock", [RbConfig.ruby, File.join(@options[:neverblock] || repo, "exe/neverblock"), "serve", app_path, "-w", "0",
                                                       "-b", "tcp://127.0.0.1:#{port}", "-C", File.join(@scratch, "neverblock.rb")],
                                        port: port)
                  end),
       Server.new(name: "puma", label: "Puma #{v['puma']} (single mode, default threads 0:5)",
                  skip: { "sse" => "5 threads: a stream holds one" },
                  start: lambda do |port|
                    peer("puma", %W[bundle exec puma --environment production --bind tcp://127.0.0.1:#{port}
                                    -C #{File.join(@scratch, 'puma.rb')} #{app_path}], port)
                  end),
       Server.new(name: "falcon", label: "Falcon #{v['falcon']} (async #{v['async']}, --count 1, --timeout #{IDLE_TIMEOUT})", skip: {},
                  start: lambda do |port|
                    peer("falcon", %W[bundle exec falcon serve --bind http://127.0.0.1:#{port} --count 1
                                      --timeout #{IDLE_TIMEOUT} --config #{app_path}], port)
                  end)]
    end

    def app_path = File.join(@scratch, "config.ru")

    def peer(name, command, port)
      PeerServers.unbundled { ServerProcess.start(name, command, port: port, env: PeerServers.bundle_env("RACK_ENV" => "production")) }
    end

    def header
      machine = <<~TEXT
        #{Machine.description}; load average #{Machine.load_average} at the start
        #{Machine.ruby_description}; #{Checkout.description}; RLIMIT_NOFILE #{@fd_limit}
      TEXT
      return "# Parked tasks\n\n#{machine}" if @parts == ["queue"]

      <<~TEXT
        # Held connections: #{@options[:connections]} per server, one process each

        #{machine.chomp}
        #{@servers.map(&:label).join('; ')}
        idle: one GET / per connection, then idle; sse: GET /sse, an event each whole second.
        Memory: VmRSS and smaps_rollup Pss of the server's session, #{@options[:settle]} s after the last connection,
        per connection over the count before; CPU: the session's user+sys over #{@options[:window]} s while held;
        fresh: #{@options[:fresh]} sequential GET / on new connections before and while held (after the CPU window).
      TEXT
    end

    # Starts the server, measures one part, stops the server.
    # @return [Result]
    def measure(part, server)
      warn "#{part}: #{server.name}"
      port = ServerProcess.free_port
      process = server.start.call(port)
      process.wait_until_ready
      fresh_requests(port, 200) # warm-up
      result = Result.new(part: part, server: server.name, held: @options[:connections],
                          fresh_before: fresh_requests(port, @options[:fresh]))
      result.rss_before, result.pss_before = memory_kb(process.pid)
      holder = Holder.start(port, @options[:connections], sse: part == "sse")
      result.opened = holder.opened
      sleep @options[:settle]
      result.rss_after, result.pss_after = memory_kb(process.pid)
      cpu = ProcessCpu.session_seconds(process.pid)
      sleep @options[:window]
      result.cpu_per_second = (ProcessCpu.session_seconds(process.pid) - cpu) / @options[:window]
      result.fresh_during = fresh_requests(port, @options[:fresh])
      report = holder.finish
      result.still_open = report[:open]
      result.events_per_second = report[:events_per_second] if part == "sse"
      result.failure = report[:failure]
      warn "  #{result.opened} opened, #{result.still_open} open at the end; RSS #{format('%.1f', result.rss_each || 0)} KB each"
      result
    rescue StandardError => e
      warn "  #{server.name} failed: #{e.class}: #{e.message}"
      Result.new(part: part, server: server.name, failure: "#{e.class}: #{e.message.lines.first&.strip}")
    ensure
      holder&.kill
      process&.stop
    end

    # @return [Array(Integer, Integer)] VmRSS and Pss in kB, summed over the session's processes
    def memory_kb(session)
      session_pids(session).map do |pid|
        rss = File.read("/proc/#{pid}/status")[/^VmRSS:\s+(\d+)/, 1].to_i
        pss = File.read("/proc/#{pid}/smaps_rollup")[/^Pss:\s+(\d+)/, 1].to_i
        [rss, pss]
      rescue SystemCallError
        [0, 0]
      end.transpose.map(&:sum)
    end

    def session_pids(session)
      Dir.glob("/proc/[0-9]*/stat").filter_map do |path|
        text = File.read(path)
        Integer(path[%r{/proc/(\d+)/}, 1]) if Integer(text[(text.rindex(")") + 2)..].split[3]) == session
      rescue SystemCallError
        nil
      end
    end

    # Times `count` sequential GET / each on a new connection.
    # @return [Samples] seconds
    def fresh_requests(port, count)
      Samples.new(Array.new(count) do
        timed do
          Socket.tcp("127.0.0.1", port) do |socket|
            socket.write("GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            HTTP.read_response(socket, NeverBlockBench.now + 10) or raise "no response to a fresh GET /"
          end
        end
      end)
    end

    def timed(&block) = NeverBlockBench.timed(&block)

    def percentile(samples, fraction)
      sorted = samples.values.sort
      sorted[((sorted.size - 1) * fraction).round]
    end

    def report(results)
      ms = ->(seconds) { seconds && format("%.2f", seconds * 1000) }
      kb = ->(value) { value && format("%.1f", value) }
      headers = ["part", "server", "open at end", "RSS before MB", "RSS KB/conn", "PSS KB/conn", "CPU ms/s held",
                 "fresh p50 ms before", "fresh p99 ms before", "fresh p50 ms held", "fresh p99 ms held", "events/s", "note"]
      rows = results.map do |r|
        [r.part, r.server, r.still_open && "#{r.still_open}/#{r.held}", r.rss_before && format("%.1f", r.rss_before / 1024.0),
         kb.call(r.rss_each), kb.call(r.pss_each), r.cpu_per_second && format("%.1f", r.cpu_per_second * 1000),
         ms.call(r.fresh_before && percentile(r.fresh_before, 0.5)), ms.call(r.fresh_before && percentile(r.fresh_before, 0.99)),
         ms.call(r.fresh_during && percentile(r.fresh_during, 0.5)), ms.call(r.fresh_during && percentile(r.fresh_during, 0.99)),
         r.events_per_second&.round, r.failure]
      end
      table = Table.new(headers, align: %i[left left] + [:right] * 10 + [:left])
      rows.each { |row| table << row }
      puts "\n#{table}"
      puts "load average #{Machine.load_average} at the end"
      write_results(rows, headers, results)
    end

    def write_results(rows, headers, results)
      categories = results.map { |r| "#{r.part} #{r.server}" }
      value = ->(r, v) { r.failure && !r.opened ? r.failure[/\A\S+ \S+ \S+/] : v }
      chart = SvgChart.new(title: "#{@options[:connections]} held connections, one server process each",
                           subtitle: [Machine.description, Machine.ruby_description])
      chart.add_panel(title: "RSS per connection (KB)", categories: categories,
                      series: { "RSS KB/conn" => results.map { |r| value.call(r, r.rss_each&.round(1)) },
                                "PSS KB/conn" => results.map { |r| value.call(r, r.pss_each&.round(1)) } })
      chart.add_panel(title: "fresh requests meanwhile, p99 (ms)", categories: categories,
                      series: { "before" => results.map { |r| value.call(r, r.fresh_before && (percentile(r.fresh_before, 0.99) * 1000).round(2)) },
                                "held" => results.map { |r| value.call(r, r.fresh_during && (percentile(r.fresh_during, 0.99) * 1000).round(2)) } })
      chart.add_panel(title: "CPU while held (ms per second)", categories: categories,
                      series: { "CPU ms/s" => results.map { |r| value.call(r, r.cpu_per_second && (r.cpu_per_second * 1000).round(1)) } })
      NeverBlockBench.write_results(@options[:out], "connections", headers, rows, chart)
    end

    # Reading one HTTP/1.1 response from a blocking-or-not socket.
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
        note = map_count_note(count)
        rows = variants.map do |variant|
          outcome = Isolated.run(timeout: 300) { measure(variant, count) }
          warn "queue: #{variant.name}: #{outcome.is_a?(Isolated::Failure) ? "FAILED #{outcome}" : format('%.2f KB/task', outcome[:rss])}"
          [variant, outcome]
        end
        report(count, rows, note)
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

      def map_count_note(count)
        needed = (count * MAPPINGS_PER_FIBER) + MAPPINGS_BESIDES
        status, value, detail = Machine.raise_sysctl("vm/max_map_count", minimum: needed, target: needed)
        case status
        when :raised then "Raised vm.max_map_count from #{value} to #{detail} (it stays raised)."
        when :failed then "vm.max_map_count=#{value} is below the #{needed} #{count} fibers need (#{detail}): expect FiberError."
        end
      end

      def report(count, rows, note)
        headers = ["variant", "RSS KB/task", "PSS KB/task", "what"]
        table = Table.new(headers, align: %i[left right right left])
        csv = rows.map do |variant, outcome|
          failed = outcome.is_a?(Isolated::Failure)
          [variant.name, (format("%.2f", outcome[:rss]) unless failed), (format("%.2f", outcome[:pss]) unless failed),
           failed ? "FAILED #{outcome}" : variant.label].tap { |row| table << row }
        end
        puts "\n## #{count} tasks parked on a Thread::Queue, memory per task (a forked child each)\n\n#{note}#{"\n" if note}#{table}"
        chart = SvgChart.new(title: "#{count} tasks parked on a Thread::Queue: memory per task",
                             subtitle: [Machine.description, Machine.ruby_description])
        chart.add_panel(title: "KB per parked task", categories: rows.map { |variant, _| variant.name },
                        series: { "RSS" => csv.map { |row| row[1]&.to_f || "failed" }, "PSS" => csv.map { |row| row[2]&.to_f || "failed" } })
        NeverBlockBench.write_results(@options[:out], "connections_queue", headers, csv, chart)
      end
    end
  end
end

if $PROGRAM_NAME == __FILE__
  NeverBlockBench::CommandLine.main(NeverBlockBench::ConnectionsBench, "connections", variants: "neverblock,puma,falcon") do |opts, options|
    opts.on("--connections N", Integer, "connections each server holds (10_000)") { |n| options[:connections] = n }
    opts.on("--fresh N", Integer, "sequential fresh requests timed before and while held (1000)") { |n| options[:fresh] = n }
    opts.on("--window SECONDS", Float, "how long the CPU of a server holding them is measured (10)") { |s| options[:window] = s }
    opts.on("--settle SECONDS", Float, "wait after the last connection before reading memory (2)") { |s| options[:settle] = s }
    opts.on("--neverblock DIR", "a checkout whose exe/neverblock serves (this one), for before/after runs") { |dir| options[:neverblock] = File.expand_path(dir) }
    opts.on("--tasks N", Integer, "tasks parked on a queue in the queue part (100_000)") { |n| options[:tasks] = n }
    opts.on("--parts LIST", Array, "idle,sse,queue (all)") { |list| options[:parts] = list }
  end
end
