# frozen_string_literal: true

require_relative "../../test_helper"
require "net/http"
require "open3"
require "tmpdir"
require "timeout"
require_relative "../../support/serve_processes"

# What a server writes, as the team reading it on its second day meets it:
# under `rackup -s neverblock` (the handler `rails server -u neverblock`
# uses) the app's lines reach a pipe as they are written; NeverBlock's own
# log follows the app's level (RAILS_LOG_LEVEL, --log-level, log_level);
# the server says where it listens; WEB_CONCURRENCY is the worker count.
class ServerLoggingTest < PlainTest
  FIXTURES = File.expand_path("../../fixtures/server", __dir__)

  include ServerProcess

  def test_the_apps_stdout_reaches_a_pipe_as_it_is_written_and_the_server_says_where_it_listens
    port = free_port
    rackup(port, "puts.ru")
    wait_for_answer(port, "/first")
    # Still running: the line is in the pipe now, not at exit (a SIGKILL or
    # an OOM kill would lose a buffered one).
    eventually { output.include?("served /first\n") }
    assert_match(/^NeverBlock #{Regexp.escape(NeverBlock::VERSION)} listening on tcp:\/\/127\.0\.0\.1:#{port} \(one process, pid #{@pid}\)$/, output)
    stop_and_wait
  end

  def test_web_concurrency_is_the_worker_count_and_rails_log_level_quiets_neverblocks_info_lines
    port = free_port
    rackup(port, "hello.ru", "-O", "Status=/_nb", env: { "WEB_CONCURRENCY" => "2", "RAILS_LOG_LEVEL" => "warn" })
    wait_for_answer(port)
    stats = Net::HTTP.get(URI("http://127.0.0.1:#{port}/_nb"))
    refute_equal @pid, Integer(stats[/"pid":(\d+)/, 1]), "answered by a worker, not the master"
    assert_match(/^NeverBlock: WEB_CONCURRENCY=2: 2 workers/, output)
    assert_match(/listening on tcp:\/\/127\.0\.0\.1:#{port} \(2 workers, pid #{@pid}\)/, output)
    assert stop_and_wait("TERM").success?
    refute_match(/ INFO -- /, output, "RAILS_LOG_LEVEL=warn: NeverBlock logs no INFO line (master got TERM...)")
  end

  def test_at_the_default_level_neverblock_logs_info_and_no_debug
    port = free_port
    rackup(port, "hello.ru", "-O", "Workers=1", env: { "RAILS_LOG_LEVEL" => nil, "NEVERBLOCK_LOG_LEVEL" => nil })
    wait_for_answer(port)
    assert stop_and_wait("TERM").success?
    assert_match(/ INFO -- neverblock: NeverBlock::Server: master got TERM/, output)
    refute_match(/ DEBUG -- /, output)
  end

  def test_a_web_concurrency_that_is_not_a_count_is_refused_in_one_line
    rackup(free_port, "hello.ru", env: { "WEB_CONCURRENCY" => "two" })
    status = begin
      Timeout.timeout(30) { Process.wait2(@pid)[1] }
    rescue Timeout::Error
      flunk "still serving 30 s later, WEB_CONCURRENCY=two ignored; output:\n#{output}"
    end
    @pid = nil
    refute status.success?
    eventually { output.include?("NeverBlock: WEB_CONCURRENCY=two is not a number of worker processes") }
  end

  def test_neverblock_serve_log_level_and_log_level_in_a_config_file
    Dir.mktmpdir do |dir|
      config = File.join(dir, "neverblock.rb")
      File.write(config, "log_level :warn\n")
      [["--log-level", "warn"], ["-C", config]].each do |args|
        port = free_port
        start(RbConfig.ruby, ServeProcesses::EXE, "serve", File.join(FIXTURES, "hello.ru"), "-b", "tcp://127.0.0.1:#{port}",
              "-w", "1", *args)
        wait_for_answer(port)
        assert stop_and_wait("TERM").success?
        refute_match(/ INFO -- /, output, args.join(" "))
        assert_match(/listening on/, output)
        @out.close
      end
      out, status = Open3.capture2e(RbConfig.ruby, ServeProcesses::EXE, "serve", File.join(FIXTURES, "hello.ru"), "--log-level", "loud")
      refute status.success?
      assert_match(/invalid argument: --log-level loud/, out)
    end
  end

  private

  def rackup(port, app, *options, env: {})
    start(RbConfig.ruby, Gem.bin_path("rackup", "rackup"), "-s", "neverblock", "-o", "127.0.0.1", "-p", port.to_s,
          "-E", "none", *options, File.join(FIXTURES, app), env: env)
  end

  def failure_context = "; output:\n#{output}"
end
