# frozen_string_literal: true

require "test_helper"
require "neverblock/server"
require_relative "../../support/idle_waiter"

# The IdleSweeper's timing wheel: a sweep looks at the connections whose
# slot ended, not at every connection it holds.
class IdleSweeperWheelTest < NeverBlockTest
  IDLE = 0.04 # seconds: a 5 ms interval

  def setup
    @sweeper = NeverBlock::Server::IdleSweeper.new(IDLE)
    @task = NeverBlock.spawn { @sweeper.run }
  end

  def teardown
    @task&.cancel
  end

  def wait_for(timeout: 30)
    deadline = NeverBlock::Clock.now + timeout
    sleep 0.002 until yield || NeverBlock::Clock.now > deadline
    assert yield, "not within #{timeout} s"
  end

  def test_connections_due_later_are_not_looked_at_by_the_sweeps_before
    now = NeverBlock::Clock.now
    far = Array.new(100) { IdleWaiter.new(now + 3600, parked: true) }
    far.each { |waiter| @sweeper.watch(waiter) }
    near = IdleWaiter.new(now + 0.05, parked: true)
    @sweeper.watch(near)
    wait_for { near.expired_at }
    assert_operator near.expired_at, :>=, now + 0.05, "expired before its deadline"
    assert_equal [1], far.map(&:looks).uniq, "looked at by sweeps before their slot (once is #watch's)"
    assert_equal 100, @sweeper.size
  end

  def test_a_wait_in_a_fiber_is_parked_after_an_interval_and_expired_at_its_deadline
    # 0.8 s ahead: on a loaded machine the sweeper's first look came after a
    # deadline IDLE ahead, and it expired the wait without parking it first.
    deadline = NeverBlock::Clock.now + (20 * IDLE)
    waiter = IdleWaiter.new(deadline)
    @sweeper.watch(waiter)
    wait_for { waiter.parks == 1 }
    assert_nil waiter.expired_at
    wait_for { waiter.expired_at }
    assert_operator waiter.expired_at, :>=, deadline
    assert_equal 1, waiter.parks
    assert_equal 0, @sweeper.size
  end

  def test_a_wait_that_cannot_park_is_looked_at_again_only_at_its_deadline
    deadline = NeverBlock::Clock.now + IDLE
    waiter = IdleWaiter.new(deadline)
    def waiter.park_idle = @parks += 1 # no IdleSet: it stays in its fiber
    @sweeper.watch(waiter)
    wait_for { waiter.expired_at }
    assert_equal 1, waiter.parks
    assert_operator waiter.looks, :<=, 4, "looked at every sweep" # watch, the park's look, the deadline's
  end

  def test_a_connection_that_waits_afresh_is_expired_at_its_new_deadline
    now = NeverBlock::Clock.now
    waiter = IdleWaiter.new(now + IDLE, parked: true)
    @sweeper.watch(waiter)
    later = now + (3 * IDLE)
    waiter.idle_deadline = later # served, and waiting again: still in its first slot
    @sweeper.watch(waiter)
    wait_for { waiter.expired_at }
    assert_operator waiter.expired_at, :>=, later
  end

  def test_a_connection_served_when_its_slot_comes_is_let_go
    now = NeverBlock::Clock.now
    waiter = IdleWaiter.new(now + IDLE, parked: true)
    @sweeper.watch(waiter)
    waiter.idle_deadline = nil # being served
    wait_for { @sweeper.size.zero? }
    assert_nil waiter.expired_at
    waiter.idle_deadline = NeverBlock::Clock.now + IDLE # its next wait
    @sweeper.watch(waiter)
    wait_for { waiter.expired_at }
  end

  def test_a_forgotten_connection_is_never_looked_at_again
    now = NeverBlock::Clock.now
    closed = IdleWaiter.new(now + IDLE, parked: true)
    open = IdleWaiter.new(now + IDLE, parked: true)
    [closed, open].each { |waiter| @sweeper.watch(waiter) }
    @sweeper.forget(closed)
    @sweeper.forget(closed) # a no-op
    wait_for { open.expired_at }
    assert_nil closed.expired_at
    assert_equal 1, closed.looks
    assert_equal 0, @sweeper.size
  end

  # Asleep with nothing watched, it starts again for the next watch.
  def test_a_sweeper_with_nothing_to_watch_starts_again_for_the_next
    first = IdleWaiter.new(NeverBlock::Clock.now + IDLE, parked: true)
    @sweeper.watch(first)
    wait_for { first.expired_at }
    wait_for { @sweeper.asleep? } # nothing to watch
    second = IdleWaiter.new(NeverBlock::Clock.now + IDLE, parked: true)
    @sweeper.watch(second)
    wait_for { second.expired_at }
  end
end
