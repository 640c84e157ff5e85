# frozen_string_literal: true

require "test_helper"
require_relative "../fixtures/child_ruby"

# `require "neverblock/rspec"` end to end: test/fixtures/rspec_cases_spec.rb
# (passing and deliberately failing examples) runs under rspec in a child
# Ruby, and these tests read its report.
class RSpecTest < PlainTest
  include ChildRuby

  FIXTURE = File.expand_path("../fixtures/rspec_cases_spec.rb", __dir__)
  RELATIVE_FIXTURE = "test/fixtures/rspec_cases_spec.rb"

  def test_passing_example_runs_with_its_hooks_inside_the_loop
    out, status = run_examples("passing")
    assert status.success?, out
    assert_includes out, "1 example, 0 failures"
    assert_equal [%w[before true], %w[example true], %w[after true]],
                 out.scan(/^PROBE (\w+) neverblocking=(\w+)$/)
  end

  def test_passing_example_finishes_without_waiting_for_its_timeout
    took = elapsed { run_examples("passing") }
    assert_operator took, :<, 20, "one quick example with a 30 s timeout"
  end

  def test_timeout_metadata_fails_the_example_with_the_live_fibers_backtraces
    out, status = run_examples("times out per example")
    refute status.success?
    assert_includes out, "timeouts times out per example timed out after 0.3 s; live fibers:"
    assert_match(/#{RELATIVE_FIXTURE}:#{fixture_line(FIXTURE, 'PER-EXAMPLE-TIMEOUT-SLEEP')}:#{TestSupport.frame('sleep')}/, out)
    assert_includes out, "1 example, 1 failure"
  end

  def test_default_timeout_comes_from_neverblock_test_timeout
    out, status = run_examples("times out by default", env: { "NEVERBLOCK_TEST_TIMEOUT" => "0.4" })
    refute status.success?
    assert_includes out, "timeouts times out by default timed out after 0.4 s; live fibers:"
    assert_match(/#{RELATIVE_FIXTURE}:#{fixture_line(FIXTURE, 'DEFAULT-TIMEOUT-SLEEP')}:#{TestSupport.frame('sleep')}/, out)
  end

  def test_an_example_that_leaks_a_task_fails
    out, status = run_examples("leaks a task")
    refute status.success?
    assert_includes out, "NeverBlock::Testing::LeakedTasks"
    assert_includes out, "leaks leaks a task left 1 task(s) running; wait for or cancel them:"
    assert_match(/#{RELATIVE_FIXTURE}:#{fixture_line(FIXTURE, 'LEAKED-TASK')}:#{TestSupport.frame('sleep')}/, out)
    assert_includes out, "1 example, 1 failure"
  end

  def test_an_example_that_leaks_a_file_descriptor_fails
    out, status = run_examples("leaks a descriptor")
    refute status.success?
    assert_includes out, "NeverBlock::Testing::LeakedDescriptors"
    assert_match(/leaks leaks a descriptor left 2 file descriptor\(s\) open; close them:\n\s+fd \d+ -> pipe:\[\d+\]/, out)
    assert_includes out, "1 example, 1 failure"
  end

  def test_neverblock_false_runs_the_example_outside_the_loop_unchecked
    out, status = run_examples("opting out")
    assert status.success?, out
    assert_includes out, "PROBE opted-out neverblocking=false"
    assert_includes out, "2 examples, 0 failures", "its leaked pipe is not checked"
  end

  private

  # Runs the fixture's examples whose full description matches `description`.
  # @return [Array(String, Process::Status)] stdout and stderr together, and the status.
  def run_examples(description, env: {})
    rspec = Gem.bin_path("rspec-core", "rspec")
    out, err, status = ruby_child(rspec, RELATIVE_FIXTURE, "--no-color", "-e", description,
                                  env: { "NEVERBLOCK_TEST_TIMEOUT" => nil }.merge(env))
    [out + err, status]
  end
end
