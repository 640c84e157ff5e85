# frozen_string_literal: true

require "test_helper"

# The loop's timer heap (lib/neverblock/timers.rb), checked against a plain
# sorted list: whatever mix of schedules and cancels, the timers due fire in
# deadline order, each once, and none that was cancelled.
class TimersTest < PlainTest
  def setup
    @timers = NeverBlock::Timers.new
    @fired = []
    @record = ->(id) { @fired << id }
  end

  def test_timers_fire_in_deadline_order_whatever_the_order_they_were_made_in
    random = Random.new(20_261_126)
    model = {}
    live = {}
    2_000.times do |id|
      delay = random.rand(0.0..10.0)
      timer = @timers.after(delay, @record, id)
      model[id] = timer.deadline
      live[id] = timer
      next unless random.rand < 0.3 # a timeout's usual fate: cancelled before it fires

      victim = live.keys.sample(random: random)
      @timers.cancel(live.delete(victim))
      model.delete(victim)
    end
    assert_equal model.size, @timers.size

    horizon = NeverBlock::Clock.now + 5.0
    @timers.fire(horizon)
    due = model.select { |_, deadline| deadline <= horizon }
    assert_equal due.keys.sort, @fired.sort
    assert_equal @fired.map { |id| model.fetch(id) }, @fired.map { |id| model.fetch(id) }.sort,
                 "the due timers did not fire in deadline order"

    @fired.clear
    @timers.fire(NeverBlock::Clock.now + 11.0)
    assert_equal (model.keys - due.keys).sort, @fired.sort
    assert_equal @fired.map { |id| model.fetch(id) }, @fired.map { |id| model.fetch(id) }.sort
    assert_equal 0, @timers.size
    assert_nil @timers.wait_interval
  end

  def test_a_timer_cancelled_after_most_of_the_heap_was_compacted_away_never_fires
    timers = Array.new(200) { |id| @timers.after(1.0 + (id * 0.001), @record, id) }
    timers.each_with_index { |timer, id| @timers.cancel(timer) unless id == 150 } # compacts along the way
    assert_equal 1, @timers.size
    assert_in_delta 1.15, @timers.wait_interval, 0.05
    @timers.fire(NeverBlock::Clock.now + 2.0)
    assert_equal [150], @fired
  end

  def test_wait_interval_is_the_time_to_the_earliest_live_timer
    late = @timers.after(3.0, @record, :late)
    early = @timers.after(1.0, @record, :early)
    assert_in_delta 1.0, @timers.wait_interval, 0.05
    @timers.cancel(early)
    assert_in_delta 3.0, @timers.wait_interval, 0.05
    @timers.cancel(late)
    assert_nil @timers.wait_interval
    assert_nil @timers.after(Float::INFINITY, @record, :never)
    assert_raises(ArgumentError) { @timers.after(Float::NAN, @record, :nan) }
    assert_raises(TypeError) { @timers.after(nil, @record, :nil) } # not "now"
    assert_raises(TypeError) { @timers.after("5", @record, :string) }
    assert_in_delta NeverBlock::Clock.now + 0.5, @timers.after(Rational(1, 2), @record, :half).deadline, 0.1
  end

  # The acceptor's StartPace reads how late the loop's last turn fired its
  # timers: the first one's lateness, when it fired several (a loop's own
  # sampler or a zero-second wait, alone, is late by the turn every turn).
  def test_late_is_the_first_timers_lateness_when_the_last_fire_fired_many
    now = NeverBlock::Clock.now
    timers = Array.new(NeverBlock::Timers::MANY) { |index| @timers.after(1.0 + index, @record, index) }
    @timers.after(60.0, @record, :not_due)
    assert_equal 0.0, @timers.late
    @timers.fire(timers.first.deadline + 5.0) # the first is 5 s late, the last 2
    assert_equal (0...NeverBlock::Timers::MANY).to_a, @fired
    assert_in_delta 5.0, @timers.late, 1e-9
    @timers.fire(now + 30.0) # nothing due
    assert_equal 0.0, @timers.late
    single = @timers.after(0.5, @record, :single)
    @timers.fire(single.deadline + 1.0)
    assert_equal 0.0, @timers.late, "one timer fired: not the loop's scheduled work"
  end
end
