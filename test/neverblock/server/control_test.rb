# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "tmpdir"
require "open3"
require "neverblock/server"
require "neverblock/cli"
require "neverblock/server/cluster/prometheus"

# The master's control listener (`--control`) and `neverblock ctl`, on real
# processes: /metrics for the whole cluster, checked by Debian's promtool and
# scraped by a real Prometheus; stats, tasks and the commands.
class ServerControlTest < PlainTest
  include ServeProcesses
  include NeverBlockTest::Databases

  TOKEN = "s3cret-token"

  def test_metrics_cover_every_worker_need_the_token_and_pass_promtool
    server = serve("postgres.ru", "-w", "2", "--control", "tcp://127.0.0.1:0", "--control-token", TOKEN, env: pg_env)
    port = control_port(server)
    eventually { worker_pids(server[:pid]).size == 2 }
    40.times { assert_equal "200", get(server, "/").code }
    assert_equal "401", control_get(port, "/metrics", token: nil).code
    assert_equal "401", control_get(port, "/metrics", token: "wrong").code
    text = eventually do
      body = control_get(port, "/metrics").body
      body if requests_total(body) == 40 # every worker's last heartbeat counted them
    end
    assert_equal 2, text.scan(/^neverblock_worker_up\{worker="\d"\} 1$/).size
    assert_match(/^neverblock_resident_memory_bytes\{worker="0"\} \d+$/, text)
    assert_match(/^neverblock_request_duration_seconds_bucket\{worker="\d",le="\+Inf"\} \d+$/, text)
    assert_match(/^neverblock_admission_wait_seconds_count\{worker="\d"\} \d+$/, text)
    assert_match(/^neverblock_loop_lag_seconds_count\{worker="\d"\} \d+$/, text)
    assert_match(/^neverblock_db_pool_size\{worker="\d",pool="[^"]*"\} \d+$/, text)
    assert_match(/^neverblock_db_pool_query_cancels_total\{worker="\d",pool="[^"]*"\} \d+$/, text)
    assert_match(/^neverblock_worker_restarts_total\{cause="watchdog"\} 0$/, text)
    output, status = Open3.capture2e("promtool", "check", "metrics", stdin_data: text)
    assert status.success?, "promtool check metrics:\n#{output}"
  end

  # docs/server.md names every series /metrics has: in full, or as a
  # `_suffix` after a series of the same family named in full
  # (`neverblock_db_pool_size`, `_in_use`).
  def test_the_server_docs_list_every_metric
    docs = File.read(File.expand_path("../../../docs/server.md", __dir__))
    named = docs.scan(/`(neverblock_[a-z_]+)`/).flatten.uniq
    missing = NeverBlock::Server::Cluster::Prometheus::FAMILIES.keys.reject do |name|
      named.include?(name) || named.any? do |full|
        [*full.enum_for(:scan, "_").map { Regexp.last_match.begin(0) }, full.size].any? do |cut|
          name.start_with?(full[0...cut]) && docs.include?("`#{name.delete_prefix(full[0...cut])}`")
        end
      end
    end
    assert_empty missing, "series /metrics has that docs/server.md does not list"
  end

  # Prometheus's counter semantics across the two restarts: a worker
  # index's count restarts with its process, the master's does not.
  def test_counters_never_go_down_across_a_rolling_restart_and_a_hot_restart_and_count_every_request
    port = free_port # (the same after the hot restart)
    server = serve("pids.ru", "-w", "2", "--control", "tcp://127.0.0.1:#{port}", "--control-token", TOKEN)
    old_workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    scrapes = []
    scraping = true
    scraper = Thread.new do
      while scraping
        body = control_get(port, "/metrics").body rescue nil # rubocop:disable Style/RescueModifier -- the listener is down during the exec
        scrapes << counter_series(body) if body
        sleep 0.05 # (pacing, not a wait: every scrape is checked)
      end
    end
    served = 0
    serve_some = lambda do |count|
      count.times { assert_equal "200", get(server).code }
      served += count
      @context = -> { "\n#{served} served, the last scrape counted #{scrapes.last && requests_total_of(scrapes.last)}; output:\n#{output_lines(server).join}" }
      eventually(timeout: 30) { scrapes.last && requests_total_of(scrapes.last) == served }
    end

    serve_some.call(10)
    Process.kill("USR2", server[:pid])
    wait_for_line(server, /rolling restart done/, timeout: 60)
    assert old_workers.none? { |pid| alive?(pid) }
    serve_some.call(5)
    before_hup = worker_pids(server[:pid])
    Process.kill("HUP", server[:pid])
    wait_for_line(server, /hot restart done; the old workers/, timeout: 60)
    # An old worker may still answer a request after the exec, which the new
    # image does not count (its status pipe stays with the old image): the
    # requests counted here go to the new workers.
    eventually(timeout: 60) { before_hup.none? { |pid| alive?(pid) } }
    serve_some.call(5)
    scraping = false
    scraper.join

    assert_equal 20, requests_total_of(scrapes.last)
    scrapes.each_cons(2) do |before, after|
      before.each do |series, value|
        assert_operator after.fetch(series, value), :>=, value, "#{series} went down"
      end
    end
    stats = JSON.parse(control_get(port, "/stats").body)
    assert_equal 20, stats["requests_total"]
    assert_equal 20, stats.dig("totals", "requests").values.sum
    assert_equal 1, stats["hot_restarts"]
  end

  def test_a_real_prometheus_scrapes_the_cluster
    server = serve("pids.ru", "-w", "2", "--control", "tcp://127.0.0.1:0", "--control-token", TOKEN)
    port = control_port(server)
    5.times { get(server) }
    Dir.mktmpdir do |dir|
      prometheus_port = free_port
      File.write(File.join(dir, "prometheus.yml"), <<~YAML)
        global: { scrape_interval: 1s }
        scrape_configs:
          - job_name: neverblock
            authorization: { credentials: #{TOKEN} }
            static_configs: [{ targets: ["127.0.0.1:#{port}"] }]
      YAML
      prometheus = Process.spawn("prometheus", "--config.file=#{dir}/prometheus.yml", "--storage.tsdb.path=#{dir}/data",
                                 "--web.listen-address=127.0.0.1:#{prometheus_port}", out: File::NULL, err: File::NULL)
      begin
        result = eventually(timeout: 60) do
          # Until its storage is up Prometheus answers 503 "Service Unavailable".
          response = Net::HTTP.get_response(URI("http://127.0.0.1:#{prometheus_port}/api/v1/query?query=sum(neverblock_requests_total)")) rescue nil # rubocop:disable Style/RescueModifier
          data = response.is_a?(Net::HTTPOK) && JSON.parse(response.body).dig("data", "result")
          data if data && !data.empty? && data.first["value"].last.to_i == 5
        end
        assert_equal "5", result.first["value"].last
        up = JSON.parse(Net::HTTP.get(URI("http://127.0.0.1:#{prometheus_port}/api/v1/query?query=up"))).dig("data", "result")
        assert_equal "1", up.first["value"].last, "Prometheus reached the target with the token"
      ensure
        Process.kill("TERM", prometheus)
        Process.wait(prometheus)
      end
    end
  end

  def test_ctl_stats_tasks_gc_phased_restart_and_stop_over_a_unix_socket
    in_tmpdir_socket do |socket|
      server = serve("hang.ru", "-w", "2", "--control", "unix://#{socket}")
      # "serving" comes once every worker accepts; the listener was there before the first fork.
      assert_equal 2, worker_pids(server[:pid]).size
      assert_equal 0o600, File.stat(socket).mode & 0o777, "guarded by its permissions, not a token"

      out, status = ctl(socket, "stats")
      assert status.success?, out
      stats = JSON.parse(out)
      assert_equal server[:pid], stats["master_pid"]
      assert_equal [0, 1], stats["workers"].map { |worker| worker["index"] }.sort

      TCPServer.open("127.0.0.1", 0) do |release|
        held = Thread.new { get(server, "/held?#{release.addr[1]}") }
        assert release.wait_readable(30), "the request for /held reached its worker"
        app = release.accept # the request is in flight until this connection gets a byte
        out, status = ctl(socket, "tasks")
        assert status.success?, out
        assert_match(/GET \/held\?\d+ from 127\.0\.0\.1, in .* waits:/, out)
        app.write(".")
        app.close
        assert_equal "200", held.value.code
      end

      out, status = ctl(socket, "gc")
      assert status.success?, out

      before = worker_pids(server[:pid])
      out, status = ctl(socket, "phased-restart")
      assert status.success?, out
      eventually(timeout: 30) { (now = worker_pids(server[:pid])).size == 2 && (now & before).empty? }

      out, status = ctl(socket, "stop")
      assert status.success?, out
      assert wait_exit(server).success?
      refute File.exist?(socket), "the socket file is removed"
    end
  end

  # Plain text, not the JSON /tasks answers with: each worker's tasks by
  # kind, each with where it comes from and its backtrace.
  def test_ctl_tasks_prints_each_workers_tasks_by_kind_as_text
    in_tmpdir_socket do |socket|
      server = serve("poller.ru", "-w", "1", "--control", "unix://#{socket}")
      worker = worker_pids(server[:pid]).first
      TCPServer.open("127.0.0.1", 0) do |release|
        held = Thread.new { get(server, "/held?#{release.addr[1]}") }
        assert release.wait_readable(30), "the request for /held reached its worker"
        app = release.accept # the request is in flight until this connection gets a byte
        out, status = ctl(socket, "tasks")
        assert status.success?, out
        fixture = Regexp.escape(File.join(FIXTURES, "poller.ru"))
        lines = File.readlines(File.join(FIXTURES, "poller.ru"))
        poller = lines.index { |line| line.include?("# POLLER_LINE") } + 1
        child = lines.index { |line| line.include?("# CHILD_LINE") } + 1
        assert_match(/\Aworker 0 \(pid #{worker}\):\n\d+ tasks: 1 requests in flight, 1 children, 1 detached, \d+ the server's own; /, out)
        assert_match(/^requests in flight \(1\):\n  GET \/held\?\d+ from 127\.0\.0\.1, in #<NeverBlock::Task:0x\h+ running [^>]*>, waits:\n    \S/, out)
        assert_match(/^children \(1\):\n  #<NeverBlock::Task:0x\h+ running \(#{fixture}:#{child}\)>, child of the request GET \/held, waits:\n    \S/, out)
        assert_match(/^detached \(1\):\n  #<NeverBlock::Task:0x\h+ running \(#{fixture}:#{poller}\)>, spawned detached at #{fixture}:#{poller}, waits:\n    \S/, out)
        app.write(".")
        app.close
        assert_equal "200", held.value.code
      end
    end
  end

  # A worker forked while the control listener holds a connection (here one
  # whose request head is not all there yet) must not keep it open: the
  # client, reading the answer to its end, would wait as long as that worker
  # lives. `neverblock ctl phased-restart` hung so on a loaded machine when
  # the new worker was forked before the answer's connection was closed.
  # (The control thread waits 5 s for the rest of a head: the fork below
  # comes well within that.)
  def test_a_worker_forked_while_a_control_connection_is_open_does_not_keep_it
    in_tmpdir_socket do |socket|
      server = serve("hang.ru", "-w", "1", "--control", "unix://#{socket}")
      sockets = socket_count(server[:pid])
      UNIXSocket.open(socket) do |client|
        client.write("GET /stats HTTP/1.0\r\n")
        eventually { socket_count(server[:pid]) > sockets } # the master took the connection
        Process.kill("TTIN", server[:pid]) # one worker more: forked now
        eventually { worker_pids(server[:pid]).size == 2 }
        client.write("\r\n")
        answer = read_to_end(client, timeout: 10)
        assert_match(%r{\AHTTP/1\.0 200 OK\r\n}, answer)
      end
    end
  end

  def test_ctl_usage_errors_and_an_unreachable_listener
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "ctl", "-C", "tcp://127.0.0.1:1", "stats")
    assert_equal 1, status.exitstatus
    assert_match(/cannot reach tcp:\/\/127\.0\.0\.1:1/, out)
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "ctl", "-C", "tcp://127.0.0.1:1", "reboot")
    assert_equal 64, status.exitstatus
    assert_match(/unknown command "reboot"/, out)
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_) {}, workers: 1, control: "http://x") }
  end

  def test_ctl_gives_up_on_a_unix_listener_that_takes_the_request_and_never_answers
    in_tmpdir_socket do |path|
      UNIXServer.open(path) do |listener|
        taken = Thread.new { listener.accept } # kept open, never answered
        out, status, took = timed_ctl("unix://#{path}", "phased-restart", "--timeout", "2")
        assert_equal 1, status.exitstatus, out
        assert_match(%r{neverblock ctl: unix://#{Regexp.escape(path)} did not answer within 2 s \(--timeout SECONDS waits longer\)}, out)
        assert_operator took, :>=, 2, "not before its timeout"
        assert_operator took, :<, 20, "about when its timeout ran out, not much later"
        connection = taken.value
        assert_equal "POST /phased-restart HTTP/1.0\r\n", connection.gets, "it was the answer that did not come"
        connection.close
      end
    end
  end

  def test_ctl_gives_up_on_a_tcp_listener_that_never_answers
    TCPServer.open("127.0.0.1", 0) do |listener| # never accepts: the kernel completes the connection alone
      out, status, took = timed_ctl("tcp://127.0.0.1:#{listener.addr[1]}", "stats", "--timeout", "2")
      assert_equal 1, status.exitstatus, out
      assert_match(%r{did not answer within 2 s}, out)
      assert_operator took, :<, 20
    end
  end

  def test_ctl_on_a_unix_socket_nobody_listens_on
    in_tmpdir_socket do |path|
      UNIXServer.new(path).close # the socket file stays, with no listener: as after a master was killed
      out, status, took = timed_ctl("unix://#{path}", "stats", "--timeout", "30")
      assert_equal 1, status.exitstatus, out
      assert_match(%r{neverblock ctl: cannot reach unix://#{Regexp.escape(path)}: Connection refused}, out)
      assert_operator took, :<, 20, "at once, not after its timeout"
    end
  end

  def test_ctl_on_a_unix_listener_whose_queue_is_full
    in_tmpdir_socket do |path|
      UNIXServer.open(path) do |listener|
        listener.listen(0)
        queued = fill_queue(path)
        out, status, took = timed_ctl("unix://#{path}", "stats", "--timeout", "30")
        assert_equal 1, status.exitstatus, out
        assert_match(%r{unix://#{Regexp.escape(path)} takes no more connections \(its queue is full\): the master does not accept them}, out)
        assert_operator took, :<, 20, "at once, not after its timeout"
      ensure
        queued&.each(&:close)
      end
    end
  end

  def test_ctl_on_a_listener_that_closes_without_answering
    in_tmpdir_socket do |path|
      UNIXServer.open(path) do |listener|
        closer = Thread.new { listener.accept.then { |connection| connection.gets && connection.close } }
        out, status = timed_ctl("unix://#{path}", "stats")
        closer.join
        assert_equal 1, status.exitstatus, out
        assert_match(%r{neverblock ctl: unix://#{Regexp.escape(path)} closed the connection without answering$}, out)
      end
    end
  end

  def test_ctl_on_a_listener_that_does_not_speak_http
    in_tmpdir_socket do |path|
      UNIXServer.open(path) do |listener|
        talker = Thread.new do
          connection = listener.accept
          connection.gets # the request came
          connection.write("SSH-2.0-OpenSSH\r\n")
          connection.close
        end
        out, status = timed_ctl("unix://#{path}", "stats")
        talker.join
        assert_equal 1, status.exitstatus, out
        assert_match(/did not answer in HTTP: "SSH-2\.0-OpenSSH\\r\\n"/, out)
      end
    end
  end

  def test_ctl_timeout_must_be_a_positive_number
    %w[0 -1 soon].each do |seconds|
      err = StringIO.new
      status = NeverBlock::CLI.new(out: StringIO.new, err: err).call(["ctl", "-C", "tcp://127.0.0.1:1", "--timeout", seconds, "stats"])
      assert_equal 64, status, err.string
      assert_match(/\Aneverblock ctl: invalid argument: --timeout/, err.string)
    end
  end

  private

  # Yields the path of a control socket in a temporary directory of its own
  # (removed afterwards).
  def in_tmpdir_socket
    Dir.mktmpdir { |dir| yield File.join(dir, "control.sock") }
  end

  # `neverblock ctl -C URL COMMAND ARGS`: output, status and wall seconds.
  def timed_ctl(url, command, *args)
    out = status = nil
    took = elapsed { out, status = Open3.capture2e(RbConfig.ruby, EXE, "ctl", "-C", url, *args, command) }
    [out, status, took]
  end

  # Connects to the unix listener at `path` until its queue takes no more.
  # @return [Array<Socket>] the connections queued.
  def fill_queue(path)
    queued = []
    loop do
      socket = Socket.new(:UNIX, :STREAM)
      queued << socket
      socket.connect_nonblock(Socket.sockaddr_un(path))
      flunk "the queue of a listen(0) socket took #{queued.size} connections" if queued.size > 64
    end
  rescue Errno::EAGAIN
    queued.pop.close
    queued
  end

  def failure_context
    @context ? @context.call : ""
  end

  def pg_env
    { "NB_TEST_PG" => JSON.generate(pg_conninfo) }
  end

  # The port a `tcp://127.0.0.1:0` control listener got, from the log.
  def control_port(server)
    Integer(wait_for_line(server, /control listener on tcp:/)[/127\.0\.0\.1:(\d+)/, 1])
  end

  def control_get(port, path, token: TOKEN)
    Net::HTTP.start("127.0.0.1", port, open_timeout: 5, read_timeout: 10) do |http|
      http.get(path, token ? { "authorization" => "Bearer #{token}" } : {})
    end
  end

  # @return [Hash{String => Float}] every counter's and histogram's series
  #   (the line without its value) and its value.
  def counter_series(text)
    text.scan(/^(neverblock_\w+(?:_total|_bucket|_sum|_count)(?:\{[^}]*\})?) (\S+)$/).to_h { |series, value| [series, Float(value)] }
  end

  def requests_total_of(series)
    series.sum { |name, value| name.start_with?("neverblock_requests_total{") ? value : 0 }.to_i
  end

  def requests_total(text)
    text.scan(/^neverblock_requests_total\{[^}]*\} (\d+)$/).flatten.sum(&:to_i)
  end

  def ctl(socket, command)
    Open3.capture2e(RbConfig.ruby, EXE, "ctl", "-C", "unix://#{socket}", command)
  end

  # Sockets the process holds (Linux /proc).
  def socket_count(pid)
    Dir.children("/proc/#{pid}/fd").count do |fd|
      File.readlink("/proc/#{pid}/fd/#{fd}").start_with?("socket:")
    rescue SystemCallError
      false # closed meanwhile
    end
  end

  # Reads `io` to its end, which comes once every process holding the
  # other end closed it.
  def read_to_end(io, timeout:)
    deadline = now + timeout
    data = +""
    loop do
      case (chunk = io.read_nonblock(4096, exception: false))
      when nil then return data
      when :wait_readable
        left = deadline - now
        next if left.positive? && io.wait_readable(left)

        flunk "the connection did not end within #{timeout} s (read so far: #{data.inspect}): " \
              "a process other than the master holds its other end"
      else data << chunk
      end
    end
  end
end
