# frozen_string_literal: true

require "test_helper"
require "neverblock/server"
require_relative "../../support/idle_waiter"

# BriefWaits: an idle wait beyond IdleSet::WAITING_FIBERS parks after two
# turns of the loop unless its connection was served meanwhile.
class BriefWaitsTest < NeverBlockTest
  def setup
    @waits = NeverBlock::Server::BriefWaits.new
    @task = NeverBlock.spawn { @waits.run }
  end

  def teardown
    @task&.cancel
  end

  def turn
    Fiber.scheduler.yield
  end

  def test_a_wait_parks_after_two_turns_not_before
    waiter = IdleWaiter.new(nil)
    @waits.add(waiter)
    turn
    assert_equal 0, waiter.parks, "parked within a turn"
    5.times { turn }
    assert_equal 1, waiter.parks
    assert_equal 0, @waits.size
  end

  def test_a_wait_that_ends_within_its_turns_is_not_parked
    waiter = IdleWaiter.new(nil)
    @waits.add(waiter)
    turn
    @waits.delete(waiter) # its next request came
    5.times { turn }
    assert_equal 0, waiter.parks
  end

  def test_waits_begun_on_later_turns_park_on_their_own_later_turns
    first = IdleWaiter.new(nil)
    @waits.add(first)
    turn
    turn
    second = IdleWaiter.new(nil)
    @waits.add(second)
    turn
    assert_equal [1, 0], [first.parks, second.parks]
    5.times { turn }
    assert_equal [1, 1], [first.parks, second.parks]
  end

  # With nothing to wait for it stops counting turns (it costs the loop nothing).
  def test_it_counts_no_turns_while_nothing_waits
    waiter = IdleWaiter.new(nil)
    @waits.add(waiter)
    5.times { turn }
    tick = @waits.instance_variable_get(:@tick)
    5.times { turn }
    assert_equal tick, @waits.instance_variable_get(:@tick)
    @waits.add(IdleWaiter.new(nil))
    5.times { turn }
    assert_operator @waits.instance_variable_get(:@tick), :>, tick
  end
end
