# frozen_string_literal: true

# What the IdleSweeper and BriefWaits ask of a connection, and what they did
# to it: how often they read its deadline (a look), when they parked or
# expired it. Real sweepers on a real loop; only the connection is this.
class IdleWaiter
  attr_reader :looks, :parks, :expired_at
  attr_writer :idle_deadline

  def initialize(deadline, parked: false)
    @idle_deadline = deadline
    @parked = parked
    @looks = 0
    @parks = 0
    @expired_at = nil
  end

  def idle_deadline
    @looks += 1
    @idle_deadline
  end

  def parked?
    @parked
  end

  def park_idle
    @parks += 1
    @parked = true
  end

  def expire_idle(now)
    return unless @idle_deadline && @idle_deadline <= now

    @expired_at = now
    @idle_deadline = nil
  end
end
