# frozen_string_literal: true

require "test_helper"
require_relative "../fixtures/child_ruby"

# `require "neverblock/minitest"` end to end: test/fixtures/minitest_cases.rb
# (passing and deliberately failing tests) runs in a child Ruby, and these
# tests read its report.
class MinitestTest < PlainTest
  include ChildRuby

  FIXTURE = File.expand_path("../fixtures/minitest_cases.rb", __dir__)
  RELATIVE_FIXTURE = "test/fixtures/minitest_cases.rb"

  def test_passing_tests_pass_with_setup_test_and_teardown_inside_the_loop
    out, status = run_cases("PassingCases")
    assert status.success?, out
    assert_match(/^2 runs, \d+ assertions, 0 failures, 0 errors, 0 skips$/, out)
    probes = out.scan(/PROBE (\w+) neverblocking=(\w+)$/)
    assert_equal %w[setup teardown setup test teardown].sort, probes.map(&:first).sort
    assert(probes.all? { |_, inside| inside == "true" }, out)
  end

  def test_passing_tests_finish_without_waiting_for_their_timeout
    took = elapsed { run_cases("PassingCases") }
    assert_operator took, :<, 20, "two quick tests with a 30 s timeout each"
  end

  def test_class_timeout_fails_the_test_with_the_live_fibers_backtraces
    out, status = run_cases("ClassTimeoutCases#test_class_timeout")
    refute status.success?
    assert_includes out, "ClassTimeoutCases#test_class_timeout timed out after 0.5 s; live fibers:"
    helper_line = fixture_line(FIXTURE, "CLASS-TIMEOUT-HELPER")
    assert_match(/#<NeverBlock::Task:0x\h+ running \(\S*#{RELATIVE_FIXTURE}:#{helper_line}\)>/, out, "the helper task")
    # Ruby 3.1 names the frame `pop'; 3.3 implements Queue#pop in Ruby and names the block
    assert_match(/#{RELATIVE_FIXTURE}:#{helper_line}:in /, out, "the helper's backtrace")
    wait_line = fixture_line(FIXTURE, "CLASS-TIMEOUT-WAIT")
    assert_match(/#{RELATIVE_FIXTURE}:#{wait_line}:#{TestSupport.frame('test_class_timeout')}/, out, "the test's backtrace")
    assert_match(/^1 runs, \d+ assertions, 1 failures, 0 errors, 0 skips$/, out)
    refute_match(/NeverBlock::Cancelled/, out, "the timeout report, not the Cancelled error it caused, is the failure")
  end

  def test_per_test_timeout_overrides_the_class_timeout
    out, status = run_cases("ClassTimeoutCases#test_per_test_timeout")
    refute status.success?
    assert_includes out, "ClassTimeoutCases#test_per_test_timeout timed out after 0.3 s; live fibers:"
    assert_match(/#{RELATIVE_FIXTURE}:#{fixture_line(FIXTURE, 'PER-TEST-TIMEOUT-SLEEP')}:#{TestSupport.frame('sleep')}/, out)
  end

  def test_default_timeout_comes_from_neverblock_test_timeout
    out, status = run_cases("DefaultTimeoutCases", env: { "NEVERBLOCK_TEST_TIMEOUT" => "0.4" })
    refute status.success?
    assert_includes out, "DefaultTimeoutCases#test_default_timeout timed out after 0.4 s; live fibers:"
  end

  def test_default_timeout_is_ten_seconds
    code = <<~RUBY
      require "neverblock/minitest"
      klass = Class.new { include NeverBlock::Minitest }
      p klass.neverblock_timeout_for(:test_anything)
    RUBY
    out, err, status = ruby_child("-e", code, env: { "NEVERBLOCK_TEST_TIMEOUT" => nil })
    assert status.success?, err
    assert_equal "10.0", out.strip
  end

  def test_a_test_that_leaks_a_task_fails
    out, status = run_cases("LeakCases#test_leaks_a_task")
    refute status.success?
    assert_includes out, "LeakCases#test_leaks_a_task left 1 task(s) running; wait for or cancel them:"
    assert_match(/#{RELATIVE_FIXTURE}:#{fixture_line(FIXTURE, 'LEAKED-TASK')}:#{TestSupport.frame('sleep')}/, out)
    assert_match(/^1 runs, \d+ assertions, 1 failures, 0 errors, 0 skips$/, out)
  end

  def test_a_test_that_leaks_a_file_descriptor_fails
    out, status = run_cases("LeakCases#test_leaks_a_descriptor")
    refute status.success?
    assert_match(/LeakCases#test_leaks_a_descriptor left 2 file descriptor\(s\) open; close them:\n  fd \d+ -> pipe:\[\d+\]\n  fd \d+ -> pipe:\[\d+\]/,
                 out)
    assert_match(/^1 runs, \d+ assertions, 1 failures, 0 errors, 0 skips$/, out)
  end

  def test_ordinary_failures_and_errors_are_reported_as_usual
    out, status = run_cases("OrdinaryFailureCases")
    refute status.success?
    assert_match(/Expected: 1\n\s+Actual: 2/, out)
    assert_includes out, "RuntimeError: raised by the test"
    assert_match(/^2 runs, \d+ assertions, 1 failures, 1 errors, 0 skips$/, out)
    refute_includes out, "unhandled", "an error inside a test is the test's, not logged by NeverBlock"
  end

  # --- neverblock_timeout, in this process ---------------------------------

  def test_neverblock_timeout_sets_the_class_default_and_per_test_values
    klass = Class.new { include NeverBlock::Minitest }
    klass.neverblock_timeout 2
    klass.neverblock_timeout 0.5, :test_quick, "test_other"
    assert_equal 2, klass.neverblock_timeout_for("test_slow")
    assert_equal 0.5, klass.neverblock_timeout_for("test_quick")
    assert_equal 0.5, klass.neverblock_timeout_for(:test_other)
  end

  def test_subclasses_inherit_the_class_timeout
    parent = Class.new { include NeverBlock::Minitest }
    parent.neverblock_timeout 3
    child = Class.new(parent)
    assert_equal 3, child.neverblock_timeout_for(:test_x)
    child.neverblock_timeout 4
    assert_equal 4, child.neverblock_timeout_for(:test_x)
    assert_equal 3, parent.neverblock_timeout_for(:test_x)
  end

  def test_neverblock_timeout_rejects_a_bad_value
    klass = Class.new { include NeverBlock::Minitest }
    [-1, Float::NAN, "5"].each do |bad|
      assert_raises(ArgumentError, bad.inspect) { klass.neverblock_timeout(bad) }
    end
  end

  private

  # Runs the fixture's tests whose names match `pattern`.
  # @return [Array(String, Process::Status)] stdout and stderr together, and the status.
  def run_cases(pattern, env: {})
    out, err, status = ruby_child(RELATIVE_FIXTURE, "-v", "-n", "/#{pattern}/",
                                  env: { "NEVERBLOCK_TEST_TIMEOUT" => nil }.merge(env))
    [out + err, status]
  end
end
