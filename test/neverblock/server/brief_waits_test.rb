# frozen_string_literal: true

require "test_helper"
require "neverblock/server"
require_relative "../../support/idle_waiter"

# BriefWaits: an idle wait beyond IdleSet::WAITING_FIBERS parks after
# BriefWaits::SECONDS and two turns of the loop unless its connection was
# served meanwhile. Most of these count turns only (seconds: 0).
class BriefWaitsTest < NeverBlockTest
  def setup
    start
  end

  def start(seconds: 0)
    @task&.cancel
    @waits = NeverBlock::Server::BriefWaits.new(seconds: seconds)
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

  # Turns alone do not make a wait brief: it lasts its seconds too.
  def test_a_wait_lasts_its_seconds_however_many_turns_pass
    start(seconds: 1)
    waiter = IdleWaiter.new(nil)
    @waits.add(waiter)
    5.times { turn }
    assert_equal 0, waiter.parks, "parked before its second"
    deadline = NeverBlock::Clock.now + 10
    turn until waiter.parks == 1 || NeverBlock::Clock.now > deadline
    assert_equal 1, waiter.parks
  end

  # With nothing to wait for its task sleeps (it costs the loop nothing)
  # until the next wait.
  def test_it_sleeps_while_nothing_waits
    waiter = IdleWaiter.new(nil)
    @waits.add(waiter)
    5.times { turn }
    assert_equal 1, waiter.parks
    assert @waits.asleep?, "awake with nothing to wait for"
    another = IdleWaiter.new(nil)
    @waits.add(another)
    5.times { turn }
    assert_equal 1, another.parks
  end
end
