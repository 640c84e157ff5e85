# frozen_string_literal: true

require "test_helper"
require "open3"
require "tmpdir"

# exe/neverblock.
class CLITest < PlainTest
  EXE = File.expand_path("../../exe/neverblock", __dir__)

  def neverblock(*args)
    Open3.capture3(RbConfig.ruby, EXE, *args)
  end

  def test_version
    out, _err, status = neverblock("version")
    assert status.success?
    assert_equal "neverblock #{NeverBlock::VERSION}\n", out
  end

  def test_help
    out, _err, status = neverblock("help")
    assert status.success?
    assert_match(/Usage: neverblock COMMAND/, out)
  end

  def test_unknown_command_is_a_usage_error
    _out, err, status = neverblock("frobnicate")
    assert_equal 64, status.exitstatus
    assert_match(/unknown command "frobnicate"/, err)
  end

  def test_run_executes_a_script_inside_the_loop_with_its_arguments
    Dir.mktmpdir do |dir|
      script = File.join(dir, "script.rb")
      File.write(script, <<~RUBY)
        started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        3.times.map { NeverBlock.spawn { sleep 0.2 } }.each(&:wait)
        took = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
        puts [NeverBlock.neverblocking?, ARGV, took < 0.5].inspect
      RUBY
      out, err, status = neverblock("run", script, "a", "b")
      assert status.success?, err
      assert_equal "[true, [\"a\", \"b\"], true]\n", out
    end
  end

  def test_run_a_missing_file_is_a_usage_error
    _out, err, status = neverblock("run", "/nonexistent.rb")
    assert_equal 64, status.exitstatus
    assert_match(/no such file/, err)
  end

  def test_dash_e_runs_code_inside_the_loop
    out, err, status = neverblock("-e", "p NeverBlock.neverblocking?")
    assert status.success?, err
    assert_equal "true\n", out
  end

  def test_an_exception_in_the_script_fails_the_command
    _out, err, status = neverblock("-e", "raise 'script failed'")
    refute status.success?
    assert_match(/script failed/, err)
  end
end
