# frozen_string_literal: true

require "test_helper"
require "socket"
require "neverblock/io_select"

# `require "neverblock/io_select"`: IO.select from NeverBlock's fibers waits
# through the loop on Ruby 3.1 (which has no io_select hook) as the hook
# makes it on 3.2+, with IO.select's results and errors; elsewhere it is
# Ruby's own. These run on every Ruby: on 3.2+ they check the hook itself.
class IOSelectTest < PlainTest
  def test_on_ruby_3_1_it_is_prepended_and_on_3_2_it_changes_nothing
    if Fiber.respond_to?(:blocking)
      refute_includes IO.singleton_class.ancestors, NeverBlock::IOSelect
    else
      assert_equal NeverBlock::IOSelect, IO.singleton_class.ancestors.first
    end
  end

  def test_ten_selects_that_time_out_wait_together
    pipes = Array.new(10) { IO.pipe }
    results = nil
    took = elapsed { results = NeverBlock.run { NeverBlock.map(pipes, concurrency: 10) { |r, _w| IO.select([r], nil, nil, 0.5) } } }
    assert_equal [nil] * 10, results
    assert_operator took, :<, 2.5, "ten 0.5 s IO.select waits took #{took.round(2)} s: one after the other"
  ensure
    pipes&.flatten&.each(&:close)
  end

  def test_a_select_returns_what_became_ready_while_other_fibers_ran
    reader, writer = IO.pipe
    other_socket, socket = UNIXSocket.pair
    ticks = 0
    result = NeverBlock.run do
      ticker = NeverBlock.spawn { 20.times { ticks += 1; NeverBlock.sleep(0.01) } }
      NeverBlock.spawn { NeverBlock.sleep(0.1); writer.write("x") }
      selected = IO.select([other_socket, reader], [], nil, 5)
      ticker.wait
      selected
    end
    assert_equal [[reader], [], []], result
    assert_operator ticks, :>=, 5, "the other fibers ran while it waited"
  ensure
    [reader, writer, other_socket, socket].each { |io| io&.close }
  end

  def test_writable_and_already_buffered_ios_are_returned_at_once
    reader, writer = IO.pipe
    writer.write("ab")
    NeverBlock.run do
      assert_equal "a", reader.getc # "b" now waits in Ruby's buffer, not in the pipe
      took = elapsed { assert_equal [[reader], [writer], []], IO.select([reader], [writer], [], 5) }
      assert_operator took, :<, 1
    end
  ensure
    reader&.close
    writer&.close
  end

  def test_bad_arguments_raise_what_ruby_raises
    reader, writer = IO.pipe
    closed, = IO.pipe.each(&:close)
    cases = [[[1]], [reader], [[closed]], [[reader], nil, nil, -1], [[reader], nil, nil, "1"], [[reader], nil, nil, Float::NAN]]
    expected = cases.map { |args| outcome { IO.select(*args) } }
    assert_equal [TypeError, TypeError, IOError, ArgumentError, TypeError, RangeError], expected.map(&:first)
    inside = NeverBlock.run { cases.map { |args| outcome { IO.select(*args) } } }
    assert_equal expected, inside
  ensure
    reader&.close
    writer&.close
  end

  # IO.select takes objects with #to_io (OpenSSL::SSLSocket is one): the
  # wait is on their IO, woken when it is ready, not at the timeout, and the
  # objects come back as given.
  def test_objects_with_to_io_are_waited_on_and_returned_as_given
    reader, writer = IO.pipe
    wrapper = Struct.new(:to_io).new(reader)
    result = nil
    took = elapsed do
      NeverBlock.run do
        NeverBlock.spawn { NeverBlock.sleep(0.05); writer.write("x") }
        result = IO.select([wrapper], nil, nil, 3)
      end
    end
    assert_equal [[wrapper], [], []], result
    assert_operator took, :<, 2, "woken only at the timeout (#{took.round(2)} s)"
  ensure
    reader&.close
    writer&.close
  end

  def test_without_ios_it_sleeps_the_timeout
    result = nil
    took = elapsed { NeverBlock.run { result = NeverBlock.map([1, 2, 3]) { IO.select(nil, nil, nil, 0.3) } } }
    assert_equal [nil, nil, nil], result
    assert_operator took, :<, 0.85, "three 0.3 s selects without IOs took #{took.round(2)} s"
  end

  def test_a_blocking_fiber_and_no_loop_get_rubys_own
    reader, writer = IO.pipe
    writer.write("x")
    assert_equal [[reader], [], []], IO.select([reader], nil, nil, 0)
    NeverBlock.run do
      assert_equal [[reader], [], []], Fiber.new(blocking: true) { IO.select([reader], nil, nil, 0) }.resume
    end
  ensure
    reader&.close
    writer&.close
  end

  private

  # [error class, message] or [:ok, value]
  def outcome
    [:ok, yield]
  rescue StandardError => e
    [e.class, e.message]
  end

  def elapsed
    started = NeverBlock::Clock.now
    yield
    NeverBlock::Clock.now - started
  end
end
