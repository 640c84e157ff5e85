# frozen_string_literal: true

require "test_helper"
require "stringio"

# The suite's per-test watchdog (test/support/watchdog.rb): a test that runs
# too long gets the process's threads, tasks and descriptors on stderr.
class WatchdogTest < PlainTest
  FIXTURE = File.expand_path("fixtures/watchdog_cases.rb", __dir__)

  # test/fixtures/watchdog_cases.rb holds its loop for 3 s; the watchdog,
  # at 1 s, names the test and shows what every part of it waits on.
  def test_a_test_that_holds_its_loop_is_reported_with_its_threads_tasks_and_descriptors
    out, err, status = ruby_child("-I#{File.expand_path(__dir__)}", FIXTURE,
                                  env: { "NEVERBLOCK_TEST_WATCHDOG" => "1" }, timeout: 60)
    assert status.success?, "#{out}\n#{err}"
    pipe, peer, port = out[/PIPE (\d+) PEER (\d+) PORT (\d+)/, 0]&.scan(/\d+/)
    assert pipe, out
    report = err[/^=== NeverBlock test watchdog: WatchdogCases#test_holds_the_loop has run for \d+ s.*?^=== end of watchdog report/m]
    assert report, err
    # The loop's thread, blocked in the test, and the kernel wait it is in.
    assert_match(/^#<Thread:0x\h+ sleep> status="sleep" tid=\d+ syscall=\S+ wchan=\S+\n    .*watchdog_cases\.rb:\d+:in .*sleep/, report)
    # The task waiting in the selector, and on what.
    assert_match(/^  #<NeverBlock::Task:0x\h+ \w+ \(.*watchdog_cases\.rb:\d+\)> waits: in the selector on #<IO:fd #{pipe}> fd #{pipe}$/, report)
    # The epoll set watches the pipe (on the epoll selector; io_uring and
    # select keep no such set); the socket's unread bytes are counted.
    if ENV.fetch("NEVERBLOCK_SELECTOR", "epoll") == "epoll"
      assert_match(/^  fd \d+ -> anon_inode:\[eventpoll\] watches .*fd #{pipe} \(events 0x\h+\)/, report)
    end
    assert_match(/^  fd #{peer} -> socket:\[\d+\] tcp 127\.0\.0\.1:#{port} -> 127\.0\.0\.1:\d+ ESTABLISHED rx 6 tx 0$/, report)
    assert_equal 1, err.scan("=== NeverBlock test watchdog: WatchdogCases#test_holds_the_loop").size,
                 "one report per test"
    # The closing of a test's loop is watched too: there it waits for the pool.
    closing = err[/^=== NeverBlock test watchdog: WatchdogCases#test_closes_its_loop_slowly .*?^=== end of watchdog report/m]
    assert closing, err
    assert_match(/^#<Thread:0x\h+ \w+> status="sleep" .*\n(    .*\n)*?    .*in .*shutdown/, closing)
  end

  def test_a_test_that_ends_in_time_is_not_reported
    output = StringIO.new
    watchdog = TestWatchdog.new(0.5, output: output)
    watchdog.watch("QuickTest#test_quick")
    watchdog.done
    watchdog.watch("SlowTest#test_slow")
    # The slow test is named, by its report or, when a report of this whole
    # suite's process fails (a thread or descriptor gone mid-read), by the
    # line saying so: this test is about which tests get one.
    eventually { output.string.include?("SlowTest#test_slow") }
    refute_includes output.string, "QuickTest"
  ensure
    watchdog&.done
  end

  def test_zero_turns_it_off
    watchdog = TestWatchdog.new(0, output: StringIO.new)
    watchdog.watch("AnyTest#test_any")
    assert_nil watchdog.instance_variable_get(:@thread), "no watchdog thread started"
  end

  def test_the_environment_variable_must_be_a_number_of_seconds
    with_env("NEVERBLOCK_TEST_WATCHDOG" => "soon") do
      error = assert_raises(ArgumentError) { TestWatchdog.seconds_from_environment }
      assert_match(/NEVERBLOCK_TEST_WATCHDOG must be a number of seconds \(0: off\), got "soon"/, error.message)
    end
    with_env("NEVERBLOCK_TEST_WATCHDOG" => "-1") do
      assert_raises(ArgumentError) { TestWatchdog.seconds_from_environment }
    end
    with_env("NEVERBLOCK_TEST_WATCHDOG" => " 90 ") { assert_in_delta 90.0, TestWatchdog.seconds_from_environment }
    with_env("NEVERBLOCK_TEST_WATCHDOG" => nil) do
      assert_in_delta TestWatchdog::DEFAULT_SECONDS, TestWatchdog.seconds_from_environment
    end
  end

  private

  def with_env(values)
    saved = values.keys.to_h { |key| [key, ENV.fetch(key, nil)] }
    values.each { |key, value| ENV[key] = value }
    yield
  ensure
    saved.each { |key, value| ENV[key] = value }
  end
end
