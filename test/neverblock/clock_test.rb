# frozen_string_literal: true

require "test_helper"
require "open3"
require "rbconfig"

# NeverBlock::Clock.now: the monotonic reading every deadline and duration in
# the library is made of, in C (ext/neverblock/monotonic) when it is built,
# else through Process.clock_gettime. Both give the same clock: a reading of
# one is comparable with a reading of the other.
class ClockTest < PlainTest
  def test_the_extension_defines_now_when_it_is_built
    assert defined?(NeverBlock::Clock), "NeverBlock::Clock"
    assert_nil NeverBlock::Clock.method(:now).source_location,
               "Clock.now is the Ruby fallback: the extension is not loaded (run the tests with bin/test, which compiles it)"
  end

  def test_now_reads_the_monotonic_clock_in_seconds
    before = Process.clock_gettime(Process::CLOCK_MONOTONIC)
    now = NeverBlock::Clock.now
    after = Process.clock_gettime(Process::CLOCK_MONOTONIC)

    assert_kind_of Float, now
    assert_operator now, :>=, before
    assert_operator now, :<=, after
  end

  def test_readings_never_go_back
    readings = Array.new(10_000) { NeverBlock::Clock.now }
    assert_equal readings.sort, readings
    sleep 0.01
    assert_operator NeverBlock::Clock.now - readings.last, :>=, 0.009, "a 10 ms sleep measured in seconds"
  end

  def test_a_module_function_as_before
    clock = Object.new.extend(NeverBlock::Clock)
    assert_kind_of Float, clock.send(:now)
    refute_respond_to clock, :now, "private in an includer, as module_function makes it"
  end

  def test_without_the_extension_the_ruby_fallback_reads_the_same_clock
    script = <<~RUBY
      require "neverblock/clock"
      location = NeverBlock::Clock.method(:now).source_location
      before = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      now = NeverBlock::Clock.now
      puts [location && File.basename(location[0]), now.class, now >= before].inspect
    RUBY
    env = { "RUBYLIB" => nil, "RUBYOPT" => nil }
    # (--disable-gems: an installed neverblock gem's built extension must not be found)
    output, status = Open3.capture2e(env, RbConfig.ruby, "--disable-gems", "-I", File.expand_path("../../lib", __dir__),
                                     "-e", script)
    assert status.success?, output
    assert_equal '["clock.rb", Float, true]', output.strip
  end
end
