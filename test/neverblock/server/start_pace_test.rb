# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"

class ServerStartPaceTest < PlainTest
  def test_a_whole_batch_while_turns_are_short
    pace = NeverBlock::Server::StartPace.new(batch: 64, turn: 0.025)
    assert_equal 64, pace.after(0.0)
    assert_equal 64, pace.after(0.025)
  end

  def test_fewer_in_proportion_as_turns_grow_and_never_fewer_than_the_least
    pace = NeverBlock::Server::StartPace.new(batch: 64, turn: 0.025, least: 8)
    assert_equal 32, pace.after(0.05)
    assert_equal 16, pace.after(0.1)
    assert_equal 8, pace.after(0.2)
    assert_equal 8, pace.after(2.0)
    assert_equal 8, pace.after(60.0)
  end
end
