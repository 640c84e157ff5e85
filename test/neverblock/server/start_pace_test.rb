# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"
require_relative "../../support/ready_descriptors"

class ServerStartPaceTest < PlainTest
  include ReadyDescriptors

  def test_a_whole_batch_while_turns_are_short
    pace = NeverBlock::Server::StartPace.new(batch: 64, turn: 0.025)
    assert_equal 64, pace.after(0.0)
    assert_equal 64, pace.after(0.025)
  end

  def test_fewer_in_proportion_as_turns_grow_and_never_fewer_than_the_least
    pace = NeverBlock::Server::StartPace.new(batch: 64, turn: 0.025, least: 8)
    assert_equal 32, pace.after(0.05)
    assert_equal 16, pace.after(0.05), "the last count scaled: a turn as long again halves it again"
    assert_equal 8, pace.after(0.1)
    assert_equal 8, pace.after(2.0)
    assert_equal 8, pace.after(60.0)
  end

  # A batch of Rails requests made a 150 ms turn: the count stays down
  # while turns stay short, and grows back a doubling a turn.
  def test_after_short_turns_the_count_grows_back_twice_a_turn
    pace = NeverBlock::Server::StartPace.new(batch: 64, turn: 0.025, least: 8)
    assert_equal 10, pace.after(0.15)
    assert_equal 20, pace.after(0.02)
    assert_equal 40, pace.after(0.02)
    assert_equal 64, pace.after(0.02)
    assert_equal 64, pace.after(0.0)
  end

  # Streams opened together: the loop on the CPU all the time, its timers
  # (the open streams' next events) later and later.
  def test_one_a_turn_while_the_loop_is_saturated_and_late_on_two_turns
    pace = NeverBlock::Server::StartPace.new
    assert_equal 64, pace.after(0.01, 0.01, 0.0)
    assert_equal 64, pace.after(0.01, 0.01, 0.005), "one late turn is a GC or the idle sweeper's pass"
    assert_equal 1, pace.after(0.01, 0.01, 0.005)
    assert_equal 1, pace.after(0.2, 0.2, 0.05), "fewer than LEAST: the open streams come first"
    assert_equal 16, pace.after(0.01, 0.002, 0.005), "with CPU to spare again, twice LEAST, then more"
    assert_equal 32, pace.after(0.01, 0.0, 0.0)
  end

  # A herd of short requests keeps the loop as busy, but no event of theirs
  # is due: their timers are on time, and they are let in a batch a turn.
  def test_a_busy_loop_whose_timers_are_on_time_takes_whole_batches
    pace = NeverBlock::Server::StartPace.new
    10.times { assert_equal 64, pace.after(0.02, 0.02, 0.0) }
    assert_equal 64, pace.after(0.02, 0.02, 0.05) # the idle sweeper's timer, once
    assert_equal 64, pace.after(0.02, 0.02, 0.0)
  end

  def test_late_timers_with_cpu_to_spare_follow_the_turn_length
    pace = NeverBlock::Server::StartPace.new
    3.times { assert_equal 64, pace.after(0.02, 0.005, 0.01) }
    assert_equal 32, pace.after(0.05, 0.01, 0.01)
  end

  # Descriptors left ready 20 ms or more on two turns, with streams open,
  # whatever the loop's share of the CPU (a loaded machine's other processes
  # may have it): none start, until it has been on time for HOLD. One turn
  # on time within it (a selector call that came back short of a batch)
  # does not end it. Late timers alone do not hold.
  def test_none_while_descriptors_stay_ready_for_long_and_for_a_while_after
    pace = NeverBlock::Server::StartPace.new
    hold = NeverBlock::Server::StartPace::HOLD
    assert_equal 64, pace.after(0.01, 0.002, 0.03, 0.03), "one late turn is a GC"
    assert_equal 0, pace.after(0.01, 0.002, 0.03, 0.03)
    assert_equal 0, pace.after(0.01, 0.002, 0.0, 0.0), "on time once, still behind"
    assert_equal 0, pace.after(0.01, 0.01, 0.0, 0.0)
    sleep hold + 0.01
    assert_equal 16, pace.after(0.01, 0.002, 0.0, 0.0), "after the hold, twice LEAST, then more"
    assert_equal 32, pace.after(0.01, 0.002, 0.0, 0.0)
    3.times { assert_equal 64, pace.after(0.01, 0.002, 0.03, 0.0) }
  end

  # A listener's pace lasts from backlog to backlog: a late turn before a
  # short pause and one after it are two late turns running. One asked
  # again after FRESH seconds starts afresh: they are not, and the count is
  # a whole batch again.
  def test_a_pace_not_asked_for_a_while_starts_afresh
    within = NeverBlock::Server::StartPace.new
    assert_equal 64, within.after(0.01, 0.002, 0.03, 0.03), "one late turn is a GC"
    sleep NeverBlock::Server::StartPace::FRESH / 5
    assert_equal 0, within.after(0.01, 0.002, 0.03, 0.03), "a pause shorter than FRESH: two late turns running"

    pace = NeverBlock::Server::StartPace.new
    assert_equal 8, pace.after(0.5, 0.1, 0.0, 0.0), "a long turn: fewer"
    assert_equal 16, pace.after(0.01, 0.002, 0.03, 0.03), "one late turn is a GC; twice the last count"
    sleep NeverBlock::Server::StartPace::FRESH + 0.05
    assert_equal 64, pace.after(0.01, 0.002, 0.03, 0.03), "after a pause, a whole batch, and the lateness before it forgotten: one late turn is a GC"
    assert_equal 0, pace.after(0.01, 0.002, 0.03, 0.03), "two running hold"
  end

  def test_the_cpu_share_is_averaged_over_turns
    pace = NeverBlock::Server::StartPace.new(busy: 0.8, late: 0.002)
    assert_equal 64, pace.after(0.01, 0.001, 0.01) # 10 % on the CPU
    assert_equal 64, pace.after(0.01, 0.01, 0.01)  # 100 %: 55 % on average
    assert_equal 64, pace.after(0.01, 0.01, 0.01)  # 78 %
    assert_equal 1, pace.after(0.01, 0.01, 0.01)   # 89 %
  end

  # Streams relayed from an upstream: the loop's work comes from IO, its
  # timers are few and on time, and its descriptors are left ready from one
  # turn to the next (Scheduler#io_late), with as many streamed responses
  # being written as streams open. That is as late as late timers.
  def test_one_a_turn_or_none_while_descriptors_stay_ready_with_streams_open
    counts = turns_beside_ready_descriptors(streams: 100, batched_only: true)
    assert_equal [0] * 5, counts.last(5), "descriptors left ready turn after turn: the pace holds: #{counts.inspect}"
  end

  # A herd of keep-alive clients, or of requests waiting on queries:
  # descriptors left ready too (their next requests, their replies), but
  # each response written whole.
  def test_descriptors_left_ready_with_few_streams_open_take_whole_batches
    counts = turns_beside_ready_descriptors(streams: 3)
    refute counts.any? { |count| count <= 1 }, "requests answered whole were taken for streams: #{counts.inspect}"
  end

  # Each open stream's next event waits for all of a turn's starts: with
  # STREAMS streams open, a few a turn, however short and on time turns are.
  def test_a_few_a_turn_with_streams_open_a_whole_batch_without
    streaming = quiet_turns(streams: NeverBlock::Server::StartPace::STREAMS)
    assert_equal [NeverBlock::Server::StartPace::STREAM_BATCH] * 5, streaming
    assert_equal [64] * 5, quiet_turns(streams: NeverBlock::Server::StartPace::STREAMS - 1)
  end

  # Connections held WAIT start whatever the pace; hundreds at once would
  # stall every open stream, so with streams open a few a turn.
  def test_those_held_too_long_start_all_at_once_or_a_few_a_turn_with_streams_open
    held = [NeverBlock::Clock.now - NeverBlock::Server::StartPace::WAIT - 1] * 300 + [NeverBlock::Clock.now] * 5
    assert_equal [300, 300], quiet_turns(streams: 3) { |pace| pace.overdue(held) }.last(2)
    streaming = quiet_turns(streams: 100) { |pace| pace.overdue(held) }
    assert_equal [NeverBlock::Server::StartPace::STREAM_BATCH] * 2, streaming.last(2)
  end

  # The loop busy with its open streams' work (fibers that compute and
  # yield, never waiting): with STREAMS streams open one starts a turn (a
  # nap), however short the turns; without, a herd is let in as ever.
  def test_one_a_nap_while_the_loop_is_busy_with_streams_open
    busy, idle = turns_beside_busy_fibers(streams: 100)
    assert_equal [1] * 5, busy.last(5)
    assert_includes idle, NeverBlock::Server::StartPace::STREAM_BATCH, "the loop idle again: #{idle.inspect}"
    busy, = turns_beside_busy_fibers(streams: 3)
    assert busy.all? { |count| count >= NeverBlock::Server::StartPace::LEAST }, busy.inspect
  end

  private

  # Eighty turns of a loop whose other fibers are always ready, each spending
  # a millisecond of CPU a turn, then twenty once they ended: what each turn
  # answered, [beside them, after them].
  def turns_beside_busy_fibers(streams:)
    NeverBlock.run do
      stop = false
      busy = Array.new(3) do
        NeverBlock.spawn do
          until stop
            spun = NeverBlock::Clock.now
            nil while NeverBlock::Clock.now - spun < 0.001
            Fiber.scheduler.yield
          end
        end
      end
      # (late: never, turn: 60 s: a loaded machine may take the CPU mid-turn; the
      # lateness rules are tested above)
      pace = NeverBlock::Server::StartPace.new(late: 60.0, turn: 60.0, streams: -> { streams })
      counts = Array.new(80) { pace.turn(Fiber.scheduler) }
      stop = true
      busy.each(&:wait)
      [counts, Array.new(20) { pace.turn(Fiber.scheduler) }]
    ensure
      stop = true
      busy&.each(&:wait)
    end
  end

  # Five turns of a loop with nothing else to run: what each answered, or
  # what the block answered after each.
  def quiet_turns(streams:)
    NeverBlock.run do
      # (never busy enough, nor turns long enough, to slow: a loaded machine may take the CPU mid-turn)
      pace = NeverBlock::Server::StartPace.new(busy: 1.1, turn: 60.0, streams: -> { streams })
      Array.new(5) do
        count = pace.turn(Fiber.scheduler)
        block_given? ? yield(pace) : count
      end
    end
  end

  def turns_beside_ready_descriptors(streams:, batched_only: false)
    counts = nil
    NeverBlock.run do
      skip_unless_batched_selector if batched_only
      # (busy: 0, whatever share of a loaded machine's CPU the loop gets; the
      # CPU share is tested above)
      pace = NeverBlock::Server::StartPace.new(busy: 0.0, streams: -> { streams })
      with_ready_fibers(100) { counts = Array.new(20) { pace.turn(Fiber.scheduler) } }
    end
    counts
  end
end
