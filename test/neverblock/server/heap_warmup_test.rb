# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "neverblock/server"
require "tmpdir"

# `neverblock serve` calls Process.warmup once the app is loaded, where the
# app then serves or forks: in the one process with -w 0, in the master
# before forking with --preload (not again in its workers: that would write
# every shared page), else in each worker (not one the refork mold forks);
# --no-warmup and a config file's `warmup false` leave it out. The fixture
# app counts the calls and answers "PID WARMUPS".
class ServerHeapWarmupTest < PlainTest
  include ServeProcesses

  def test_one_process_warms_up_once_before_serving
    server = serve("warmup.ru", "-w", "0")
    assert_equal [server[:pid], 1], pids(server)
    assert_equal ["warmup in #{server[:pid]}\n"], warmup_lines(server)
  end

  def test_no_warmup_leaves_it_out
    server = serve("warmup.ru", "-w", "0", "--no-warmup")
    assert_equal [server[:pid], 0], pids(server)
    assert_empty warmup_lines(server)
  end

  # Development boots often: no warmup there unless asked.
  def test_the_development_environment_warms_up_only_when_asked
    assert_equal 0, pids(serve("warmup.ru", "-w", "0", "-E", "development")).last
    assert_equal 1, pids(serve("warmup.ru", "-w", "0", "-E", "development", "--warmup")).last
  end

  def test_a_config_file_can_leave_it_out_and_the_command_line_wins
    Dir.mktmpdir do |dir|
      config = File.join(dir, "neverblock.rb")
      File.write(config, "warmup false\n")
      assert_equal 0, pids(serve("warmup.ru", "-w", "0", "-C", config)).last
      assert_equal 1, pids(serve("warmup.ru", "-w", "0", "-C", config, "--warmup")).last
    end
  end

  def test_workers_that_load_the_app_warm_up_each_their_own
    server = serve("warmup.ru", "-w", "2")
    workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    answers = eventually { (a = Array.new(20) { pids(server) }.uniq).size == 2 && a }
    assert_equal workers.sort, answers.map(&:first).sort
    answers.each { |_pid, warmups| assert_equal 1, warmups }
    assert_equal workers.map { |pid| "warmup in #{pid}\n" }.sort, warmup_lines(server).sort
  end

  # After the app's before_fork (what it lets go is garbage the workers
  # would otherwise share).
  def test_a_preloaded_app_warms_up_in_the_master_only_after_before_fork
    Dir.mktmpdir do |dir|
      config = File.join(dir, "neverblock.rb")
      File.write(config, "before_fork { $stdout.puts('before_fork'); $stdout.flush }\n")
      server = serve("warmup.ru", "-w", "2", "--preload", "-C", config)
      answers = eventually { (a = Array.new(20) { pids(server) }.uniq).size == 2 && a }
      refute_includes answers.map(&:first), server[:pid]
      answers.each { |_pid, warmups| assert_equal 1, warmups, "the master's warmup, inherited; none of its own" }
      assert_equal ["before_fork\n", "warmup in #{server[:pid]}\n"], output_lines(server).grep(/\A(warmup in|before_fork)/)
    end
  end

  # The mold warms up before it forks (its children share its pages); the
  # workers it forks have the app loaded and warm up no more.
  def test_workers_forked_by_the_refork_mold_do_not_warm_up_again
    skip NeverBlock::Server::Cluster::Refork.unavailable if NeverBlock::Server::Cluster::Refork.unavailable
    server = serve("warmup.ru", "-w", "1", "--refork-after", "5,false")
    first, = pids(server)
    answer = eventually { (a = pids(server)).first != first && a }
    assert_equal 2, answer.last, "its boot's warmup and the mold's, none of its own"
    assert_equal ["warmup in #{first}\n"] * 2, warmup_lines(server), "the first worker's boot, then as the mold"
  end

  private

  def warmup_lines(server)
    output_lines(server).grep(/\Awarmup in /)
  end
end
