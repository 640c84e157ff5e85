# frozen_string_literal: true

require_relative "../../test_helper"
require "tmpdir"
require "fileutils"
require "open3"

# `rackup -s neverblock` and `bin/rails server -u neverblock`, as real
# processes (lib/rackup/handler/neverblock.rb).
class ServerHandlerTest < PlainTest
  FIXTURES = File.expand_path("../../fixtures/server", __dir__)

  include ServerProcess

  def teardown
    super
    FileUtils.rm_rf(@dir) if @dir
  end

  def test_rackup_s_neverblock
    port = free_port
    start_rackup(port, "-E", "development", File.join(FIXTURES, "hello.ru"))
    response = wait_for_answer(port)
    assert_equal "200", response.code
    # Served inside NeverBlock, and rackup's development stack (Rack::Lint
    # among it) found nothing wrong with the env or the response.
    assert_equal "hello from NeverBlock::Scheduler\n", response.body
    status = stop_and_wait
    assert status.success? || status.signaled?, status.inspect
    refute_match(/Rack::Lint::LintError|Error/, @output)
  end

  def test_rackup_with_workers_forks
    port = free_port
    start_rackup(port, "-O", "Workers=2", "-O", "Status=/_nb", "-E", "none", File.join(FIXTURES, "hello.ru"))
    wait_for_answer(port)
    stats = Net::HTTP.get(URI("http://127.0.0.1:#{port}/_nb"))
    refute_equal @pid, Integer(stats[/"pid":(\d+)/, 1]), "answered by a worker, not the master"
    assert stop_and_wait("TERM").success?
  end

  # The app is loaded when the handler runs: it warms up the heap before
  # serving (fixtures/server/warmup.ru counts Process.warmup's calls and
  # answers "PID WARMUPS"); Warmup=false leaves it out, and so does the
  # development environment unless Warmup=true.
  def test_rackup_warms_up_the_loaded_app_unless_told_not_to
    { %w[-E none] => 1, %w[-E none -O Warmup=false] => 0, %w[-E development] => 0,
      %w[-E development -O Warmup=true] => 1 }.each do |options, expected|
      port = free_port
      start_rackup(port, *options, File.join(FIXTURES, "warmup.ru"))
      pid = @pid
      assert_equal [pid, expected], wait_for_answer(port).body.split.map { |number| Integer(number) }, options.inspect
      assert stop_and_wait("TERM").success?
      assert_equal ["warmup in #{pid}"] * expected, @output.scan(/^warmup in \d+/)
    end
  end

  # With workers, the master warms up after the app's before_fork (what
  # that lets go is garbage the workers would share), and the workers share
  # it; config/neverblock.rb's `warmup false` applies to the handler too.
  def test_rackup_with_workers_warms_up_in_the_master_after_before_fork_and_reads_warmup_false
    @dir = Dir.mktmpdir("nb-warmup")
    FileUtils.mkdir_p(File.join(@dir, "config"))
    config = File.join(@dir, "config", "neverblock.rb")
    File.write(config, "before_fork { $stdout.puts('before_fork'); $stdout.flush }\n")
    port = free_port
    start_rackup(port, "-O", "Workers=2", "-E", "none", File.join(FIXTURES, "warmup.ru"), chdir: @dir)
    master = @pid
    pid, warmups = wait_for_answer(port).body.split.map { |number| Integer(number) }
    refute_equal master, pid, "answered by a worker"
    assert_equal 1, warmups, "the master's, inherited"
    assert stop_and_wait("TERM").success?
    assert_equal ["before_fork", "warmup in #{master}"], @output.scan(/^(?:before_fork|warmup in \d+)$/)

    File.write(config, "warmup false\n")
    port = free_port
    start_rackup(port, "-E", "none", File.join(FIXTURES, "warmup.ru"), chdir: @dir)
    assert_equal 0, wait_for_answer(port).body.split.last.to_i
    assert stop_and_wait("TERM").success?
    assert_match(%r{NeverBlock: reading config/neverblock.rb\n}, @output, "warmup is not named as left out")

    port = free_port # rackup's -O wins over the file
    start_rackup(port, "-O", "Warmup=true", "-E", "none", File.join(FIXTURES, "warmup.ru"), chdir: @dir)
    assert_equal 1, wait_for_answer(port).body.split.last.to_i
    assert stop_and_wait("TERM").success?
  end

  def test_rails_server_u_neverblock
    copy_rails_app
    port = free_port
    start_rails_server(port, env: { "RAILS_MAX_THREADS" => nil })
    response = wait_for_answer(port, timeout: 90)
    assert_equal "200", response.code
    # RAILS_MAX_THREADS was unset: the handler set it to 25 before the app
    # initialized, so a generated database.yml's pool is 25, not 5.
    assert_match(/\Arails \d+ NeverBlock::Scheduler pool=25\n\z/, response.body)
    stop_and_wait
    assert_match(/Booting NeverBlock/, @output)
  end

  # As `rails server` reads config/puma.rb for Puma, the handler reads
  # config/neverblock.rb (what `neverblock serve -C` reads): an upload limit
  # raised there applies, and what only `neverblock serve` does is named.
  def test_rails_server_u_neverblock_reads_config_neverblock_rb
    copy_rails_app
    File.write(File.join(@dir, "config", "neverblock.rb"), "limits max_body: 16\npidfile 'tmp/x.pid'\n")
    port = free_port
    start_rails_server(port)
    assert_equal "200", wait_for_answer(port, timeout: 90).code
    response = Net::HTTP.start("127.0.0.1", port) { |http| http.post("/", "x" * 17, "content-type" => "text/plain") }
    assert_equal "413", response.code
    stop_and_wait
    assert_match(%r{NeverBlock: reading config/neverblock.rb; pidfile apply to `neverblock serve -C` only}, @output)
    assert_match(/refused a request from 127\.0\.0\.1 with 413: Content-Length 17 over 16; to raise the limit: --max-body/, @output)
  end

  def test_rails_server_u_neverblock_on_a_port_in_use_says_so_in_one_line
    copy_rails_app
    taken = TCPServer.new("127.0.0.1", 0)
    port = taken.addr[1]
    out, status = Open3.capture2e(RbConfig.ruby, "bin/rails", "server", "-u", "neverblock", "-b", "127.0.0.1", "-p", port.to_s,
                                  "-P", File.join(@dir, "server.pid"), chdir: @dir)
    assert_equal 1, status.exitstatus, out
    assert_includes out, "NeverBlock: Address already in use - cannot listen on tcp://127.0.0.1:#{port}"
    refute_match(/^\s+(from )?\S+\.rb:\d+:in /, out, "no backtrace")
  ensure
    taken&.close
  end

  def test_rails_server_u_neverblock_keeps_a_rails_max_threads_it_finds
    copy_rails_app
    port = free_port
    start_rails_server(port, env: { "RAILS_MAX_THREADS" => "40" })
    response = wait_for_answer(port, timeout: 90)
    assert_match(/ pool=40\n\z/, response.body)
    stop_and_wait
  end

  # Rails 8's Dockerfile runs `./bin/thrust ./bin/rails server` and Kamal's
  # deploy.yml sets SOLID_QUEUE_IN_PUMA: with `-u neverblock` the app's
  # bin/jobs (here a stand-in that notes its start and its TERM) runs under
  # a master, beside one worker, and stops with the server.
  def test_rails_server_u_neverblock_supervises_bin_jobs_under_solid_queue_in_puma
    copy_rails_app
    FileUtils.cp(File.join(FIXTURES, "sidecar_app", "bin", "jobs"), File.join(@dir, "bin", "jobs"))
    events = File.join(@dir, "jobs.log")
    port = free_port
    start_rails_server(port, env: { "SOLID_QUEUE_IN_PUMA" => "true", "SIDECAR_EVENTS" => events })
    response = wait_for_answer(port, timeout: 90)
    refute_includes response.body, "rails #{@pid} ", "answered by the worker, not the master"
    jobs = Integer(eventually { File.exist?(events) && File.read(events)[/^started (\d+) #{Regexp.escape(File.realpath(@dir))}$/, 1] })
    assert stop_and_wait("TERM").success?, @output
    assert_includes File.read(events), "stopped #{jobs}\n"
    assert_match(%r{NeverBlock: a master supervises bin/jobs beside 1 worker \(for more: WEB_CONCURRENCY=N, or `workers N` in config/neverblock.rb}, @output)
  end

  def test_rails_server_u_neverblock_under_solid_queue_in_puma_without_bin_jobs_says_so
    copy_rails_app
    port = free_port
    start_rails_server(port, env: { "SOLID_QUEUE_IN_PUMA" => "true" })
    assert_match(/\Arails #{@pid} /, wait_for_answer(port, timeout: 90).body, "served in the one process")
    stop_and_wait
    assert_includes @output, "NeverBlock: SOLID_QUEUE_IN_PUMA is set but #{File.realpath(@dir)}/bin/jobs does not exist; " \
                             "not running Solid Queue"
  end

  # An explicit `workers 0` in config/neverblock.rb (`rails server` has
  # no -O) keeps the one process: bin/jobs is not run, and the server says why.
  def test_rails_server_u_neverblock_with_workers_0_in_config_under_solid_queue_in_puma_runs_no_bin_jobs
    copy_rails_app
    FileUtils.cp(File.join(FIXTURES, "sidecar_app", "bin", "jobs"), File.join(@dir, "bin", "jobs"))
    File.write(File.join(@dir, "config", "neverblock.rb"), "workers 0\n")
    events = File.join(@dir, "jobs.log")
    port = free_port
    start_rails_server(port, env: { "SOLID_QUEUE_IN_PUMA" => "true", "SIDECAR_EVENTS" => events })
    assert_match(/\Arails #{@pid} /, wait_for_answer(port, timeout: 90).body, "served in the one process")
    stop_and_wait
    refute File.exist?(events), "bin/jobs ran"
    assert_match(/supervise needs a master \(workers: 1 or more\); with workers: 0 nothing runs bin\/jobs/, @output)
  end

  private

  # `rackup -s neverblock` on 127.0.0.1:`port`, with `args` (options, then
  # the rackup file).
  def start_rackup(port, *args, chdir: Dir.pwd)
    start(RbConfig.ruby, Gem.bin_path("rackup", "rackup"), "-s", "neverblock", "-o", "127.0.0.1", "-p", port.to_s, *args,
          chdir: chdir)
  end

  # The Rails fixture app, copied to @dir (a fresh temporary directory).
  def copy_rails_app
    @dir = Dir.mktmpdir("nb-rails")
    FileUtils.cp_r(File.join(FIXTURES, "rails_app", "."), @dir)
  end

  # `bin/rails server -u neverblock` in @dir on 127.0.0.1:`port`.
  def start_rails_server(port, env: {})
    start(RbConfig.ruby, "bin/rails", "server", "-u", "neverblock", "-b", "127.0.0.1", "-p", port.to_s,
          "-P", File.join(@dir, "server.pid"), chdir: @dir, env: env)
  end

  def failure_context = "; output:\n#{@output}"
end
