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
    start(RbConfig.ruby, Gem.bin_path("rackup", "rackup"), "-s", "neverblock", "-o", "127.0.0.1", "-p", port.to_s,
          "-E", "development", File.join(FIXTURES, "hello.ru"))
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
    start(RbConfig.ruby, Gem.bin_path("rackup", "rackup"), "-s", "neverblock", "-o", "127.0.0.1", "-p", port.to_s,
          "-O", "Workers=2", "-O", "Status=/_nb", "-E", "none", File.join(FIXTURES, "hello.ru"))
    wait_for_answer(port)
    stats = Net::HTTP.get(URI("http://127.0.0.1:#{port}/_nb"))
    refute_equal @pid, Integer(stats[/"pid":(\d+)/, 1]), "answered by a worker, not the master"
    assert stop_and_wait("TERM").success?
  end

  def test_rails_server_u_neverblock
    @dir = Dir.mktmpdir("nb-rails")
    FileUtils.cp_r(File.join(FIXTURES, "rails_app", "."), @dir)
    port = free_port
    start(RbConfig.ruby, "bin/rails", "server", "-u", "neverblock", "-b", "127.0.0.1", "-p", port.to_s,
          "-P", File.join(@dir, "server.pid"), chdir: @dir, env: { "RAILS_MAX_THREADS" => nil })
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
    @dir = Dir.mktmpdir("nb-rails")
    FileUtils.cp_r(File.join(FIXTURES, "rails_app", "."), @dir)
    File.write(File.join(@dir, "config", "neverblock.rb"), "limits max_body: 16\npidfile 'tmp/x.pid'\n")
    port = free_port
    start(RbConfig.ruby, "bin/rails", "server", "-u", "neverblock", "-b", "127.0.0.1", "-p", port.to_s,
          "-P", File.join(@dir, "server.pid"), chdir: @dir)
    assert_equal "200", wait_for_answer(port, timeout: 90).code
    response = Net::HTTP.start("127.0.0.1", port) { |http| http.post("/", "x" * 17, "content-type" => "text/plain") }
    assert_equal "413", response.code
    stop_and_wait
    assert_match(%r{NeverBlock: reading config/neverblock.rb; pidfile apply to `neverblock serve -C` only}, @output)
    assert_match(/refused a request from 127\.0\.0\.1 with 413: Content-Length 17 over 16; to raise the limit: --max-body/, @output)
  end

  def test_rails_server_u_neverblock_on_a_port_in_use_says_so_in_one_line
    @dir = Dir.mktmpdir("nb-rails")
    FileUtils.cp_r(File.join(FIXTURES, "rails_app", "."), @dir)
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
    @dir = Dir.mktmpdir("nb-rails")
    FileUtils.cp_r(File.join(FIXTURES, "rails_app", "."), @dir)
    port = free_port
    start(RbConfig.ruby, "bin/rails", "server", "-u", "neverblock", "-b", "127.0.0.1", "-p", port.to_s,
          "-P", File.join(@dir, "server.pid"), chdir: @dir, env: { "RAILS_MAX_THREADS" => "40" })
    response = wait_for_answer(port, timeout: 90)
    assert_match(/ pool=40\n\z/, response.body)
    stop_and_wait
  end
end
