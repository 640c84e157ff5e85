# frozen_string_literal: true

require_relative "../../test_helper"
require "json"
require "net/http"
require "timeout"
require "open3"
require "tmpdir"
require "fileutils"
require "etc"
require_relative "../../support/serve_processes"

# `neverblock serve` and the preforking master (NeverBlock::Server::Cluster),
# run as real processes: workers, respawn, signals, rolling restart,
# --preload, boot failures, the status endpoint.
class ServerClusterTest < PlainTest
  include ServeProcesses

  def test_two_workers_answer_and_the_app_loads_in_each_worker_without_preload
    server = serve("pids.ru", "-w", "2")
    workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    answered = Array.new(40) { pids(server) }
    answered.each { |by, loaded_in| assert_equal by, loaded_in, "loaded in the worker itself" }
    assert_empty answered.map(&:first).uniq - workers
    refute_includes answered.map(&:first), server[:pid]
  end

  def test_json_access_log_lines_name_the_worker
    server = serve("pids.ru", "-w", "1", "--access-log", "--access-log-format", "json")
    pids(server)
    line = wait_for_line(server, /"path":"\/"/)
    assert_equal 0, JSON.parse(line)["worker"]
  end

  def test_preload_loads_the_app_once_in_the_master
    server = serve("pids.ru", "-w", "2", "--preload")
    by, loaded_in = pids(server)
    assert_equal server[:pid], loaded_in
    refute_equal server[:pid], by
    assert_equal 1, server[:lines].count { |line| line.start_with?("loaded in") }
  end

  def test_a_worker_that_dies_is_replaced
    server = serve("pids.ru", "-w", "2")
    before = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    Process.kill("KILL", before.first)
    after = eventually { (w = worker_pids(server[:pid])).size == 2 && !w.include?(before.first) && w }
    assert_includes after, before.last
    20.times { pids(server) }
    assert(server[:lines].none? { |line| line.include?("BootError") })
  end

  # Requests that kill their worker, many a second, right as new workers
  # start accepting: those deaths are not boot failures, and the master
  # keeps replacing workers and serving.
  def test_an_app_whose_requests_crash_their_workers_never_takes_the_master_down
    server = serve("pids.ru", "-w", "2")
    eventually { worker_pids(server[:pid]).size == 2 }
    stop = false
    killers = Array.new(6) do
      Thread.new do
        until stop
          begin
            # Short timeouts: no /die request is answered, and a killer left
            # waiting 30 s (get's read_timeout) made this test take a minute.
            Net::HTTP.start("127.0.0.1", server[:port], open_timeout: 2, read_timeout: 2) { |http| http.get("/die") }
          rescue StandardError
            nil # the worker died under this request, as asked
          end
        end
      end
    end
    # Until five workers died and were replaced (a loaded machine may take
    # seconds to boot each), not a fixed time.
    begin
      eventually(timeout: 60) do
        output_lines(server).count { |line| line.include?("died (signal KILL)") } >= 5 || !alive?(server[:pid])
      end
    ensure
      stop = true
      killers.each(&:join)
    end
    lines = output_lines(server)
    assert alive?(server[:pid]), "the master exited:\n#{lines.join}"
    respawned = lines.count { |line| line.include?("died (signal KILL)") }
    assert_operator respawned, :>=, 5, lines.join
    assert(lines.none? { |line| line.match?(/boot failure|giving up|BootError/) }, lines.join)
    eventually { worker_pids(server[:pid]).size == 2 }
    20.times { pids(server) }
  end

  # Without -b/-p, the PORT variable's port (Thruster, Heroku and Foreman
  # set it for the server they start, as Puma and rails server read it).
  def test_port_from_the_environment_when_no_bind_is_given
    port = free_port
    server = spawn_serve("pids.ru", "-w", "0", env: { "PORT" => port.to_s }, bind: false)
    line = wait_for_line(server, /serving .* on (tcp:\S+)/)
    assert_includes line, "tcp://0.0.0.0:#{port}"
    assert_equal "200", Net::HTTP.get_response(URI("http://127.0.0.1:#{port}/")).code

    out, status = Open3.capture2e({ "PORT" => "http" }, RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "pids.ru"), "-w", "0")
    assert_equal 64, status.exitstatus
    assert_match(/PORT=http is not a port number/, out)
  end

  def test_max_body_bounds_request_bodies
    server = serve("pids.ru", "-w", "0", "--max-body", "100")
    ok = Net::HTTP.start("127.0.0.1", server[:port]) { |http| http.post("/", "x" * 100) }
    assert_equal "200", ok.code
    refused = Net::HTTP.start("127.0.0.1", server[:port]) { |http| http.post("/", "x" * 101) }
    assert_equal "413", refused.code
  end

  # Request fibers get Ruby's small fiber stacks by default; the option
  # restarts the command with bigger ones (the same pid keeps serving).
  def test_fiber_stack_size_lets_requests_recurse_deeper
    default = serve("deep.ru", "-w", "0")
    assert_match(/\ASystemStackError /, get(default, "/?20000").body)

    server = serve("deep.ru", "-w", "0", "--fiber-stack-size", "8M")
    assert_equal "depth 20000 #{8 * 1024 * 1024}\n", get(server, "/?20000").body
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "deep.ru"), "--fiber-stack-size", "lots")
    assert_equal 64, status.exitstatus
    assert_match(/--fiber-stack-size lots/, out)
  end

  def test_a_config_file_sets_workers_limits_hooks_and_a_pidfile_and_the_command_line_wins
    Dir.mktmpdir do |dir|
      config = File.join(dir, "neverblock.rb")
      File.write(config, <<~RUBY)
        workers 1
        limits max_body: 100
        pidfile "neverblock.pid"
        before_fork { $stdout.puts "before fork in \#{Process.pid}"; $stdout.flush }
        on_worker_boot { |index| $stdout.puts "worker boot \#{index}"; $stdout.flush }
      RUBY
      server = serve("pids.ru", "-C", config, "-w", "2")
      wait_for_line(server, /before fork in #{server[:pid]}/)
      wait_for_line(server, /worker boot 0/)
      wait_for_line(server, /worker boot 1/) # -w 2 on the command line beat the file's 1
      eventually { worker_pids(server[:pid]).size == 2 }
      pidfile = File.join(dir, "neverblock.pid") # relative to the config file
      assert_equal "#{server[:pid]}\n", File.read(pidfile)
      refused = Net::HTTP.start("127.0.0.1", server[:port]) { |http| http.post("/", "x" * 101) }
      assert_equal "413", refused.code
      Process.kill("TERM", server[:pid])
      assert wait_exit(server).success?
      refute File.exist?(pidfile), "the pidfile outlived the master"
    end
  end

  # The file's constants resolve as in any Ruby file: docs/server.md's
  # `before_fork { ActiveRecord::Base... }` raised NameError for
  # NeverBlock::ActiveRecord::Base.
  def test_a_config_file_names_constants_as_at_the_top_level
    Dir.mktmpdir do |dir|
      config = File.join(dir, "neverblock.rb")
      File.write(config, "before_fork { puts ActiveRecord::Base.name }\nworkers defined?(Server) ? 2 : 1\n")
      out, err, status = run_ruby(<<~RUBY)
        require "active_record"
        require "neverblock/active_record"
        require "neverblock/server"
        require "neverblock/cli"
        require "neverblock/cli/config_file"
        options = NeverBlock::CLI::ConfigFile.load(#{config.inspect})
        options[:before_fork].call
        puts options[:workers]
      RUBY
      assert status.success?, err
      assert_equal "ActiveRecord::Base\n1\n", out
    end
  end

  # establish_connection in config.ru, no Rails: serve loaded neverblock
  # before ActiveRecord, so nothing registered the adapters in time.
  def test_a_config_ru_using_active_record_without_rails_finds_the_neverblock_adapters
    server = serve("active_record.ru", "-w", "0")
    assert_equal "NeverBlock::ActiveRecord::PostgreSQLAdapter\n", get(server, "/").body
  end

  # A generated database.yml reads RAILS_MAX_THREADS (else 5) for the pool.
  def test_serve_sets_rails_max_threads_when_it_is_unset_and_keeps_a_set_one
    Dir.mktmpdir do |dir|
      FileUtils.mkdir_p(File.join(dir, "config"))
      File.write(File.join(dir, "config", "database.yml"), "production:\n  pool: <%= ENV.fetch('RAILS_MAX_THREADS') { 5 } %>\n")
      File.write(File.join(dir, "config.ru"), "run ->(_env) { [200, {}, [ENV['RAILS_MAX_THREADS'].to_s]] }\n")
      port = free_port
      { nil => "25", "8" => "8" }.each do |given, expected|
        env = { "RAILS_MAX_THREADS" => given }
        out, writer = IO.pipe
        pid = Process.spawn(env, RbConfig.ruby, EXE, "serve", File.join(dir, "config.ru"), "-p", port.to_s, "-w", "0",
                            out: writer, err: writer)
        writer.close
        body = nil
        eventually(timeout: 30) { body = (Net::HTTP.get(URI("http://127.0.0.1:#{port}/")) rescue nil) }
        assert_equal expected, body
        Process.kill("TERM", pid)
        Process.wait(pid)
        pid = nil
        said = out.read
        if given
          refute_match(/RAILS_MAX_THREADS was not set/, said)
        else
          assert_match(/RAILS_MAX_THREADS was not set: set to 25/, said)
        end
      ensure
        out&.close
        if pid # a failed assertion: the next server needs the port
          Process.kill("KILL", pid)
          Process.wait(pid)
        end
      end
    end
  end

  # ssl_bind in a config file, with paths relative to the file, served by
  # forked workers (the TLS context is built in the master).
  def test_a_config_file_ssl_bind_serves_https_from_the_workers
    Dir.mktmpdir do |dir|
      FileUtils.mkdir_p(File.join(dir, "config", "tls"))
      TestCertificates.write_self_signed(File.join(dir, "config", "tls"))
      port = free_port
      File.write(File.join(dir, "config", "neverblock.rb"),
                 "ssl_bind \"127.0.0.1\", #{port}, cert: \"tls/cert.pem\", key: \"tls/key.pem\"\nworkers 2\n")
      pid = Process.spawn(RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "pids.ru"), "-C", "config/neverblock.rb",
                          chdir: dir, pgroup: true, out: File::NULL, err: File::NULL)
      (@servers ||= []) << { pid: pid, out: IO.pipe.first, lines: [] }
      http = Net::HTTP.new("127.0.0.1", port)
      http.use_ssl = true
      http.ca_file = File.join(dir, "config", "tls", "cert.pem")
      body = nil
      eventually(timeout: 30) { body = (http.start { |h| h.get("/").body } rescue nil) }
      refute_equal pid.to_s, body[/\d+/], "answered by a worker"
      Process.kill("TERM", pid)
      assert Process.wait2(pid)[1].success?
    end
  end

  def test_an_unknown_config_setting_is_a_usage_error_naming_the_line
    Dir.mktmpdir do |dir|
      config = File.join(dir, "neverblock.rb")
      File.write(config, "workers 2\nthreads 5\n")
      out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "hello.ru"), "-C", config)
      assert_equal 64, status.exitstatus
      assert_match(/neverblock\.rb:2: unknown setting threads/, out)
    end
  end

  # -p (not an abbreviation of --preload), --log, the master's log of the
  # signals it acts on, and the process titles.
  def test_port_log_file_signals_and_process_titles
    port = free_port
    Dir.mktmpdir do |dir|
      log = File.join(dir, "server.log")
      terminal, writer = IO.pipe
      pid = Process.spawn(RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "pids.ru"), "-p", port.to_s, "-w", "1",
                          "--access-log", "--log", log, pgroup: true, out: writer, err: File::NULL)
      writer.close
      (@servers ||= []) << { pid: pid, out: IO.pipe.first, lines: [] }
      # The terminal says where the log went; everything else goes there.
      assert_equal "NeverBlock #{NeverBlock::VERSION}: logging to #{log}\n", Timeout.timeout(30) { terminal.gets }
      eventually { File.exist?(log) && File.read(log).include?("serving") }
      assert_match(%r{on tcp://0\.0\.0\.0:#{port} }, File.read(log))
      worker = eventually { (w = worker_pids(pid)).size == 1 && w.first }
      eventually { File.read("/proc/#{worker}/cmdline").include?("neverblock worker 0") }
      assert_includes File.read("/proc/#{pid}/cmdline"), "neverblock master (1 worker)"
      assert_equal "200", Net::HTTP.get_response(URI("http://127.0.0.1:#{port}/")).code
      eventually { File.read(log).include?('"GET / HTTP/1.1" 200') } # the access log, line by line
      Process.kill("TTIN", pid)
      eventually { File.read(log).include?("master got TTIN: one worker more (2 workers)") }
      Process.kill("TERM", pid)
      Process.wait(pid)
      assert_includes File.read(log), "master got TERM: stopping gracefully"
      assert_nil terminal.gets, "nothing but the one line on the terminal"
    ensure
      terminal&.close
    end
  end

  def test_term_lets_in_flight_requests_finish_then_exits
    server = serve("pids.ru", "-w", "2", "--shutdown-timeout", "10")
    slow = Thread.new { get(server, "/slow?1.5") }
    wait_for_line(server, /slow request in/) # the request is in a worker's app now
    Process.kill("TERM", server[:pid])
    response = slow.value
    assert_equal "200", response.code
    status = wait_exit(server)
    assert status.success?, "master exit status #{status.inspect}"
    assert_raises(Errno::ECONNREFUSED) { TCPSocket.new("127.0.0.1", server[:port]) }
  end

  def test_the_shutdown_timeout_cancels_requests_that_run_too_long
    server = serve("pids.ru", "-w", "1", "--shutdown-timeout", "1")
    slow = Thread.new do
      get(server, "/slow?60")
    rescue StandardError => e
      e
    end
    wait_for_line(server, /slow request in/)
    Process.kill("INT", server[:pid])
    took = elapsed { assert wait_exit(server, timeout: 50).success? }
    assert_operator took, :<, 30, "the 60 s request was not cut off by --shutdown-timeout 1"
    slow.join(5)
  end

  def test_usr2_replaces_every_worker_without_refusing_a_connection
    server = serve("pids.ru", "-w", "2")
    before = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    failures = []
    answered_by = Hash.new(0)
    stop = false
    clients = Array.new(4) do
      Thread.new do
        until stop
          begin
            answered_by[pids(server).first] += 1
          rescue StandardError, Minitest::Assertion => e
            failures << e
          end
        end
      end
    end
    begin
      # The old workers answer first, and the new ones once they are up:
      # waited for, not given a time a loaded machine may not be enough.
      eventually { (answered_by.keys & before).any? }
      Process.kill("USR2", server[:pid])
      after = eventually { (w = worker_pids(server[:pid])).size == 2 && (w & before).empty? && w }
      eventually { (answered_by.keys & after).any? || failures.any? }
    ensure
      stop = true
      clients.each(&:join)
    end
    assert_empty failures, "requests failed during the rolling restart: #{failures.first(3).map(&:inspect)}"
    assert (answered_by.keys & after).any?, "the new workers answered: #{answered_by.inspect} #{after.inspect}"
    assert (answered_by.keys & before).any?, "the old workers answered before: #{answered_by.inspect} #{before.inspect}"
  end

  # Keep-alive clients (raw sockets: Net::HTTP would retry a GET the server
  # dropped and hide the loss) see no failed request while every worker is
  # replaced: an old worker answers the requests already on their way with
  # `connection: close` before it exits, instead of closing idle
  # connections under them.
  def test_usr2_under_keep_alive_load_fails_no_request
    server = serve("pids.ru", "-w", "2")
    before = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    stop = false
    counts = Array.new(8) { { ok: 0, failed: [] } }
    answered = -> { counts.sum { |c| c[:ok] } }
    results = counts.map do |mine|
      Thread.new do
        socket = nil
        until stop
          begin
            socket ||= TCPSocket.new("127.0.0.1", server[:port])
            socket.write("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            head = socket.readline("\r\n\r\n")
            socket.read(Integer(head[/content-length: (\d+)/i, 1]))
            mine[:ok] += 1
            if head.match?(/^connection: close/i)
              socket.close
              socket = nil
            end
          rescue StandardError => e
            mine[:failed] << e
            socket&.close
            socket = nil
          end
        end
        socket&.close
      end
    end
    begin
      # Requests flow before, between and after the restarts (counted, not
      # given a time that a loaded machine may spend elsewhere).
      2.times do
        so_far = answered.call
        eventually { answered.call > so_far + 20 }
        Process.kill("USR2", server[:pid])
        before = eventually { (w = worker_pids(server[:pid])).size == 2 && (w & before).empty? && w }
      end
      eventually { answered.call > 100 }
    ensure
      stop = true
      results.each(&:join)
    end
    failed = counts.flat_map { |c| c[:failed] }
    assert_operator counts.sum { |c| c[:ok] }, :>, 100
    assert_empty failed, "#{failed.size} requests failed during the rolling restarts: #{failed.first(3).map(&:inspect)}"
  end

  def test_a_rolling_restart_into_a_broken_app_is_abandoned_and_the_old_workers_keep_serving
    marker = File.join(Dir.tmpdir, "nb-break-#{Process.pid}-#{rand(1 << 30)}")
    server = serve("flip.ru", "-w", "1", env: { "NB_TEST_BREAK" => marker })
    old = eventually { (w = worker_pids(server[:pid])).size == 1 && w }
    assert_equal old.first, pids(server).first # booted (the app is loaded) before the deploy breaks
    File.write(marker, "")
    Process.kill("USR2", server[:pid])
    wait_for_line(server, /rolling restart abandoned/, timeout: 30)
    assert_equal old, worker_pids(server[:pid])
    assert_equal old.first, pids(server).first
    File.delete(marker)
    Process.kill("USR2", server[:pid]) # a fixed deploy restarts fine
    fresh = eventually { (w = worker_pids(server[:pid])).size == 1 && w != old && w }
    eventually { pids(server).first == fresh.first }
  ensure
    File.delete(marker) if marker && File.exist?(marker)
  end

  def test_ttin_and_ttou_change_the_worker_count
    server = serve("pids.ru", "-w", "1")
    eventually { worker_pids(server[:pid]).size == 1 }
    Process.kill("TTIN", server[:pid])
    eventually { worker_pids(server[:pid]).size == 2 }
    Process.kill("TTOU", server[:pid])
    eventually { worker_pids(server[:pid]).size == 1 }
  end

  def test_a_worker_that_stops_leaves_the_others_idle
    server = serve("pids.ru", "-w", "2")
    eventually { worker_pids(server[:pid]).size == 2 }
    Process.kill("TTOU", server[:pid])
    survivor = eventually { (w = worker_pids(server[:pid])).size == 1 && w.first }
    get(server) # the survivor serves
    before = cpu_seconds(survivor)
    sleep 1
    # Idle, it sleeps in the selector; a busy loop takes the whole second.
    assert_operator cpu_seconds(survivor) - before, :<, 0.5, "the remaining worker spins after another one stopped"
  end

  def test_workers_stop_when_the_master_is_killed
    server = serve("pids.ru", "-w", "2")
    workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    Process.kill("KILL", server[:pid])
    Process.wait(server[:pid])
    eventually { workers.none? { |pid| alive?(pid) && !File.read("/proc/#{pid}/stat").include?(") Z ") } }
  end

  # The first failure comes with its backtrace, the retries in one line
  # each, and the command ends with one line saying why.
  def test_an_app_that_cannot_boot_makes_the_master_give_up_in_one_clear_line
    server = spawn_serve("broken.ru", "-w", "2")
    status = wait_exit(server, timeout: 60)
    output = server[:out].read
    assert_match(/\ANeverBlock \S+ listening on tcp:\S+ \(2 workers, pid \d+\); the workers are booting$/, output.lines.first)
    refute_match(/serving/, output, "not said before the app answers")
    refute status.success?
    assert_match(/broken on purpose/, output)
    assert_match(/\Aneverblock serve: the app failed to boot \d+ times in a row \(RuntimeError: this app is broken on purpose \(\S*broken\.ru:4\)\); giving up/,
                 output.lines.last)
    backtraces = output.lines.count { |line| line.include?("parse_file") }
    assert_equal 1, backtraces, "the backtrace was logged more than once:\n#{output}"
    # Beside that one backtrace (its length varies with the Ruby: 3.4's has
    # more frames), one line per failure or retry and the final line.
    messages = output.lines.reject { |line| line.start_with?("/", "<internal") }
    assert_operator messages.size, :<, 20, output
    last_failure = output.lines.grep(/exited before its app booted/).last
    refute_match(/retrying in/, last_failure, "no retry follows the failure the master gives up on")
  end

  def test_an_address_in_use_is_one_clear_line
    taken = TCPServer.new("127.0.0.1", 0)
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "hello.ru"),
                                  "-b", "tcp://127.0.0.1:#{taken.addr[1]}", "-w", "0")
    assert_equal 1, status.exitstatus
    assert_equal "neverblock serve: Address already in use - cannot listen on tcp://127.0.0.1:#{taken.addr[1]}\n", out
  ensure
    taken&.close
  end

  def test_preload_surfaces_a_broken_app_before_forking
    reader, writer = IO.pipe
    pid = Process.spawn(RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "broken.ru"), "-b", "tcp://127.0.0.1:0",
                        "-w", "2", "--preload", out: writer, err: writer)
    writer.close
    status = Timeout.timeout(30) { Process.wait2(pid)[1] }
    output = reader.read
    refute status.success?
    assert_match(/broken on purpose/, output)
    refute_match(/serving/, output)
  ensure
    reader&.close
  end

  def test_status_endpoint_reports_the_worker
    server = serve("pids.ru", "-w", "1", "--status", "/_nb")
    stats = JSON.parse(get(server, "/_nb").body)
    worker = worker_pids(server[:pid]).first
    assert_equal worker, stats["pid"]
    assert_equal 0, stats["worker"]
    assert_equal 1, stats["requests_in_flight"]
    assert_kind_of Hash, stats["fiber_pool"]
    assert_equal "405", Net::HTTP.start("127.0.0.1", server[:port]) { |h| h.post("/_nb", "", "content-type" => "text/plain") }.code
  end

  def test_single_process_mode_serves_and_stops_on_term
    server = serve("pids.ru", "-w", "0")
    by, loaded_in = pids(server)
    assert_equal server[:pid], by
    assert_equal server[:pid], loaded_in
    Process.kill("TERM", server[:pid])
    assert wait_exit(server).success?
  end

  def test_usage_errors
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", "/nonexistent.ru")
    assert_equal 64, status.exitstatus
    assert_match(/no such file/, out)
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "pids.ru"), "-w", "many")
    assert_equal 64, status.exitstatus
    assert_match(/invalid argument/, out)
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", "--help")
    assert status.success?
    assert_match(/--preload/, out)
  end
end

# Database pools created before fork (--preload) are rebuilt in each worker.
class ServerClusterDatabaseTest < PlainTest
  include ServeProcesses
  include NeverBlockTest::Databases

  def test_preloaded_database_pools_get_new_connections_in_each_worker
    server = serve("postgres.ru", "-w", "2", "--preload", env: { "NB_TEST_PG" => JSON.generate(pg_conninfo) })
    master_backend = Integer(server[:lines].join[/master backend (\d+)/, 1])
    backends = Array.new(30) { Integer(get(server, "/").body) }
    # Both workers answer in the end; on a loaded machine one may take every
    # request while the other is still starting (a CI pass saw 30 from one).
    eventually do
      next true if backends.uniq.size >= 2

      backends << Integer(get(server, "/").body)
      false
    end
    refute_includes backends, master_backend, "a worker used the master's connection"
    assert_operator backends.uniq.size, :>=, 2
  end
end
