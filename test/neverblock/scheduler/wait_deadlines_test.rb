# frozen_string_literal: true

require "test_helper"

# A timed IO wait's timer, kept from wait to wait
# (lib/neverblock/scheduler/wait_deadlines.rb): each wait still ends at its
# own timeout, neither sooner nor later, and a fiber's timed waits no longer
# make a timer each.
class WaitDeadlinesTest < NeverBlockTest
  # A fiber waits in the selector throughout, as a server's listener does:
  # else a turn with none there drops every wait's timer
  # (test_no_timer_is_left_once_nothing_waits_in_the_selector), and these
  # tests would not see a timer kept from one wait to the next.
  def setup
    super
    @pipes = []
    listener, @stop = pipe
    @listener = NeverBlock.spawn { listener.wait_readable }
  end

  def teardown
    @stop.write("x")
    @listener.wait
    @pipes.flatten.each(&:close)
    super
  end

  # A pipe with a byte waiting: a timed wait on it ends at once, ready.
  def ready_pipe
    pipe.tap { |_, writer| writer.write("x") }
  end

  def pipe
    IO.pipe.tap { |pair| @pipes << pair }
  end

  # A pipe whose byte a task writes `seconds` from now: its reader.
  def pipe_written_after(seconds)
    reader, writer = pipe
    NeverBlock.spawn do
      sleep seconds
      writer.write("x")
    end
    reader
  end

  def test_a_shorter_timeout_after_longer_ones_ends_on_time
    reader, = ready_pipe
    50.times { assert reader.wait_readable(60) }
    quiet, = pipe
    started = NeverBlock::Clock.now
    result = NeverBlock.timeout(10) { quiet.wait_readable(0.05) }
    assert_nil result, "the wait ended by its own timeout"
    assert_operator NeverBlock::Clock.now - started, :<, 5, "the 0.05 s wait waited for the 60 s timer"
  end

  def test_a_longer_timeout_after_a_shorter_one_is_not_cut_at_the_first
    reader, = ready_pipe
    assert reader.wait_readable(0.02) # its timer stays in the heap, due in 0.02 s
    slow = pipe_written_after(0.2)
    started = NeverBlock::Clock.now
    assert slow.wait_readable(5), "the 5 s wait timed out at the 0.02 s wait's deadline"
    assert_operator NeverBlock::Clock.now - started, :>=, 0.15
  end

  # The timer kept from the first wait fires first, moves itself to the
  # second wait's deadline, and then expires that wait.
  def test_a_longer_timeout_after_a_shorter_one_still_times_out
    reader, = ready_pipe
    assert reader.wait_readable(0.02)
    quiet, = pipe
    started = NeverBlock::Clock.now
    result = NeverBlock.timeout(10) { quiet.wait_readable(0.2) }
    assert_nil result, "the wait ended by its own timeout"
    assert_operator NeverBlock::Clock.now - started, :>=, 0.15, "the 0.2 s wait ended at the 0.02 s wait's deadline"
  end

  # A timed wait ended by an exception (a timeout around it, a cancel)
  # leaves nothing armed: the fiber's next wait, untimed, is not expired.
  def test_an_interrupted_timed_wait_expires_nothing_later
    quiet, = pipe
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.01) { quiet.wait_readable(0.05) } }
    slow = pipe_written_after(0.2)
    assert slow.wait_readable, "an untimed wait was expired by an interrupted wait's deadline"
  end

  # A task's fiber that ended is not kept (nor its task, nor the task's
  # value) until its last timed wait's timeout.
  def test_an_ended_tasks_fiber_is_not_kept_for_its_last_waits_timeout
    reader, = ready_pipe
    ended = ObjectSpace::WeakMap.new # these tasks' fibers, held by nothing here
    200.times do
      NeverBlock.spawn do
        ended[Fiber.current] = true
        reader.wait_readable(60)
      end.wait
    end
    GC.start
    kept = ended.keys.size
    assert_operator kept, :<, 100, "#{kept} of 200 ended fibers kept" # (the GC may see a few on the stack)
  end

  def test_a_timed_wait_that_ended_wakes_nothing_later
    reader, = ready_pipe
    assert reader.wait_readable(0.02)
    slow = pipe_written_after(0.2)
    assert slow.wait_readable, "an untimed wait was woken by an earlier wait's timer"
    other = pipe_written_after(0.2)
    assert other.wait_readable(5), "a timed wait was woken by an earlier wait's timer"
  end

  def test_each_wait_still_times_out_on_its_own_when_nothing_comes
    quiet, = pipe
    3.times do
      started = NeverBlock::Clock.now
      assert_nil quiet.wait_readable(0.03)
      assert_operator NeverBlock::Clock.now - started, :>=, 0.025, "the wait ended before its timeout"
    end
  end

  def test_a_fibers_timed_waits_share_one_timer
    timers = Fiber.scheduler.instance_variable_get(:@timers)
    pushed = 0
    counter = Module.new do
      define_method(:at) do |*args|
        pushed += 1
        super(*args)
      end
    end
    timers.singleton_class.prepend(counter)
    reader, = ready_pipe
    1_000.times { assert reader.wait_readable(60) }
    assert_operator pushed, :<=, 10, "1,000 timed waits of one fiber pushed #{pushed} timers" # (the loop's own: the close watch)
  end

  # With no fiber waiting in the selector, no wait's timer is left: the
  # loop's timers are its sleeps (with none, it parks, and Ruby can tell a
  # deadlock).
  def test_no_timer_is_left_once_nothing_waits_in_the_selector
    result = Thread.new do
      NeverBlock.run do
        reader, writer = IO.pipe
        writer.write("x")
        reader.wait_readable(60)
        sleep 0.01 # a turn with nothing in the selector
        timers = Fiber.scheduler.instance_variable_get(:@timers).instance_variable_get(:@heap)
        left = timers.count do |timer|
          !timer.cancelled? && timer.instance_variable_get(:@callable).is_a?(NeverBlock::Scheduler::WaitDeadlines::Deadline)
        end
        reader.close
        writer.close
        left
      end
    end.value
    assert_equal 0, result
  end
end
