# frozen_string_literal: true

require_relative "compat_helper"

# The matrix's own rules (test/support/compat.rb): a row never claims a fix
# it does not need, nor one that does not exist.
class CompatMatrixTest < CompatTest
  def test_an_unknown_fix_is_an_argument_error
    error = assert_raises(ArgumentError) { assert_concurrent_calls("sleep", fix: :hope) { nil } }
    assert_includes error.message, ":hope"
  end

  # Plain sleeps are concurrent: a row that says they need defer fails, from
  # what the child Ruby measured without the fix.
  def test_a_fix_for_calls_that_are_concurrent_anyway_fails_the_row
    failure = begin
      assert_concurrent_calls("sleep", fix: :defer) { sleep DELAY }
      nil
    rescue Minitest::Skip
      raise # in the child: the probe's own skip
    rescue Minitest::Assertion => e
      e
    end
    refute_nil failure, "a row with a fix it does not need passed"
    assert_match(/2 plain calls ran at once in 0\.\d+ s: this row needs no fix now/, failure.message)
  end
end
