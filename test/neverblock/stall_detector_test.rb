# frozen_string_literal: true

require "test_helper"
require "digest"
require_relative "../fixtures/child_ruby"

# The stall detector: one warning, naming the task and showing its
# backtrace, when a fiber holds the loop past the threshold without
# yielding. These tests start loops with their own thresholds, so they run
# outside one.
class StallDetectorTest < PlainTest
  include ChildRuby

  WARNING = "has held the event loop"
  DETECTOR = "neverblock-stall-detector"

  def test_busy_task_logs_one_warning_naming_it_with_its_backtrace
    spawn_line = nil
    log = with_log do |io|
      NeverBlock.run(stall_threshold: 0.1) do
        spawn_line = __LINE__ + 1
        NeverBlock.spawn do
          burn_cpu { io.string.include?(WARNING) } # until the detector has spoken
          burn_cpu(0.4) { false } # the same stall goes on: no second warning
        end.wait
      end
    end
    assert_equal 1, log.scan(WARNING).size, log
    assert_match(/WARN -- NeverBlock: #<NeverBlock::Task:0x\h+ running \(#{Regexp.escape("#{__FILE__}:#{spawn_line}")}\)> #{WARNING}/,
                 log)
    assert_includes log, "stall threshold 100 ms"
    assert_match(/^  #{Regexp.escape(__FILE__)}:\d+:#{TestSupport.frame('burn_cpu')}$/, log, "the backtrace shows the busy code")
  end

  # A C call that keeps the GVL (an SQLite query, here a digest of 150 MB)
  # also stops the detector's thread: before, it woke after the call to a
  # new switch count and saw no stall at all (a 1 s SQLite query went
  # unreported). It is reported by the detector's late wake: on Ruby 3.1
  # and 3.2 with the frame the call returned to; on 3.3+, which hands the
  # GVL over only at the fiber's next wait here, without a backtrace.
  #
  # The detector tells such a call from a process that got no CPU by the CPU
  # the process used meanwhile: on a machine so loaded that the digest got
  # under a quarter of the wall time it took, it stays silent, rightly. A
  # silent run in which the digest got less than half a CPU is such a run,
  # and is tried again (up to five runs; if every one was starved, the test is
  # skipped as unable to tell); a silent run with the CPU to spare fails.
  def test_a_c_call_that_keeps_the_gvl_is_reported
    big = "x" * 150_000_000 # 0.3-1 s
    log = nil
    shares = []
    5.times do
      share = nil
      log = with_log do
        NeverBlock.run(stall_threshold: 0.1) do
          NeverBlock.spawn do
            sleep 0.3 # the detector's thread runs and samples first
            share = cpu_share { Digest::SHA256.digest(big) }
          end
          NeverBlock.spawn { 20.times { sleep 0.02 } } # another fiber that waits meanwhile
        end
      end
      shares << share.round(2)
      break unless log.empty? && share < 0.5
    end
    if log.empty? && shares.all? { |share| share < 0.5 }
      skip "the digest got under half a CPU in every run (#{shares.join(', ')}): too loaded to tell"
    end
    if RUBY_VERSION < "3.3"
      assert_equal 1, log.scan(WARNING).size, log # (by the late wake, or a sample taken after the switch)
      first_frame = log[/It is here:\n  (.*)$/, 1]
      assert_match(/#{Regexp.escape(__FILE__)}:\d+:(?:#{TestSupport.frame('update')}|#{TestSupport.frame('digest')})/,
                   first_frame, "the frame the C call returned to")
    else
      assert_equal 1, log.lines.grep(/WARN/).size, log
      assert_match(/Ruby's GVL was held for at least \d+ ms by a call that kept it|in a call that kept Ruby's GVL/, log)
    end
  end

  # A process that gets no CPU for a while (a busy machine; here SIGSTOP)
  # also wakes the detector late, with a fiber running: not a stall of the
  # loop's making, and not reported.
  #
  # The stopper is started before the loop: Process.spawn itself keeps the
  # GVL while it forks, which on a loaded machine took 209 ms and was (rightly)
  # reported as a stall.
  def test_a_process_that_waits_for_a_cpu_is_not_reported
    stopper = Process.spawn("sleep 0.5; kill -STOP #{Process.pid}; sleep 1.2; kill -CONT #{Process.pid}")
    log = with_log do
      NeverBlock.run(stall_threshold: 0.1) do
        NeverBlock.spawn do
          deadline = now + 30
          until exited?(stopper) || now > deadline # short steps of CPU, with a yield between them
            burn_cpu(0.005) { false }
            sleep 0
          end
        end
      end
    end
    Process.wait(stopper)
    assert_predicate $?, :success?, "the stopper ran to its end (STOP, CONT) while the loop turned"
    assert_empty log
  end

  # The same with the process stopped in the middle of a fiber's step: the
  # watchdog, having seen the fiber run before the stop, finds it still
  # running after SIGCONT. The time the process was stopped is not the
  # fiber's: 450 ms of its own, over two samples, under the 500 ms threshold
  # (the watchdog counts about 125 + 150 of them).
  def test_a_fiber_stopped_with_its_process_is_not_charged_for_the_stop
    pid = Process.pid
    continuer = Process.spawn("until grep -q '^State:.*T' /proc/#{pid}/status; do sleep 0.01; done; " \
                              "sleep 1.2; kill -CONT #{pid}")
    log = with_log do
      NeverBlock.run(stall_threshold: 0.5) do
        NeverBlock.spawn do
          NeverBlock.sleep(0.1) # the watchdog waits for the loop to run
          burn_cpu(0.3) { false } # it samples the fiber (a timeslice after it began), sleeps, waits for the GVL
          Process.kill(:STOP, pid)
          burn_cpu(0.15) { false } # a timeslice after SIGCONT at most, it samples the fiber again
        end
      end
    end
    Process.wait(continuer)
    assert_predicate $?, :success?
    assert_empty log
  end

  # Ruby 3.3+ hands a waiting thread the GVL a timeslice after it asked, or
  # later on a loaded machine: a late look can find another fiber turn than
  # the last look's. The watchdog's looks, given here one by one: held over
  # a look, the late wake is blamed on the fiber if it still runs then (a
  # Ruby loop: its backtrace), or reported as a GVL hold if it switched.
  def test_a_late_look_after_a_switch_is_told_by_the_next_look
    NeverBlock.run(stall_threshold: nil) do
      fiber = Fiber.current
      still_running = with_log do |io|
        detector = NeverBlock::StallDetector.new(Fiber.scheduler, 0.1)
        detector.send(:look, fiber, 1, 10.0, 0.0, true)
        detector.send(:look, fiber, 3, 10.5, 0.47, true) # 470 ms late, after a switch
        assert_empty io.string if RUBY_VERSION >= "3.3"
        detector.send(:look, fiber, 3, 10.62, 0.0, true) # the same turn, 120 ms on
      end
      switched = with_log do
        detector = NeverBlock::StallDetector.new(Fiber.scheduler, 0.1)
        detector.send(:look, fiber, 1, 10.0, 0.0, true)
        detector.send(:look, fiber, 3, 10.5, 0.47, true)
        detector.send(:look, fiber, 5, 10.6, 0.0, true) # another turn
      end
      [still_running, switched].each { |log| assert_equal 1, log.lines.grep(/WARN/).size, log }
      assert_match(/#{WARNING}.*It is here:\n  /m, still_running, "the fiber still running, with its backtrace")
      if RUBY_VERSION >= "3.3"
        assert_includes switched, "Ruby's GVL was held for at least 470 ms by a call that kept it"
      end
    end
  end

  def test_each_separate_stall_is_reported
    log = with_log do |io|
      NeverBlock.run(stall_threshold: 0.1) do
        burn_cpu { io.string.scan(WARNING).size == 1 }
        NeverBlock.sleep(0.001) # yields: the next hold is a new stall
        burn_cpu { io.string.scan(WARNING).size == 2 }
      end
    end
    assert_equal 2, log.scan(WARNING).size, log
  end

  # A development server's file watcher stalls on every request: one
  # backtrace, then a line per stall for a while.
  def test_stalls_soon_after_a_reported_backtrace_are_one_line
    log = with_log do |io|
      NeverBlock.run(stall_threshold: 0.1) do
        3.times do |i|
          burn_cpu { io.string.scan(WARNING).size == i + 1 }
          NeverBlock.sleep(0.001)
        end
      end
    end
    reports = log.split(/^(?=W, )/)
    assert_equal 3, reports.size, log
    assert_match(/It is here:\n  /, reports[0])
    reports.drop(1).each.with_index(1) do |report, quiet|
      assert_equal 1, report.lines.size, report
      assert_match(/#{WARNING} .* at .*:\d+:in .*; #{quiet} such report\(s\) in one line since the last backtrace$/, report)
    end
  end

  def test_a_fiber_that_yields_often_logs_nothing
    log = with_log do
      NeverBlock.run(stall_threshold: 0.1) do
        started = now
        sleep 0.001 while now - started < 0.3
      end
    end
    assert_empty log
  end

  # The loop waiting in the selector with nothing to run is idle, whichever
  # fiber ran last: here the cross-thread wake-up's watcher, which reads its
  # pipe through the scheduler's io_read hook on Ruby 3.3+ (a
  # warning blamed it ~0.14 s into every MySQL pool run on 3.4).
  def test_an_idle_wait_after_a_wake_up_from_another_thread_is_not_a_stall
    log = with_log do
      NeverBlock.run(stall_threshold: 0.05) do
        3.times do
          queue = Thread::Queue.new
          Thread.new { queue << :done }
          queue.pop # woken through the wake-up pipe
          NeverBlock.sleep(0.3) # idle in the selector meanwhile
        end
      end
    end
    assert_empty log
  end

  def test_the_threshold_is_configurable_per_loop
    log = with_log do
      NeverBlock.run(stall_threshold: 5) { burn_cpu(0.4) { false } }
    end
    assert_empty log, "0.4 s is well under a 5 s threshold"

    log = with_log do |io|
      NeverBlock.run(stall_threshold: 0.2) { burn_cpu { io.string.include?(WARNING) } }
    end
    assert_includes log, "stall threshold 200 ms"
  end

  def test_nil_or_false_turns_the_detector_off
    [nil, false].each do |off|
      detectors = nil
      log = with_log do
        NeverBlock.run(stall_threshold: off) do
          detectors = detector_threads
          burn_cpu(0.4) { false }
        end
      end
      assert_empty log, "stall_threshold: #{off.inspect}"
      assert_empty detectors, "no watchdog thread with stall_threshold: #{off.inspect}"
    end
  end

  def test_the_detector_thread_is_gone_after_the_loop_ends
    before = detector_threads
    during = NeverBlock.run(stall_threshold: 0.1) { detector_threads - before }
    assert_equal 1, during.size, "one watchdog thread while the loop runs"
    refute during.first.alive?, "the watchdog is joined when the loop ends"
    assert_equal before, detector_threads
  end

  def test_the_detector_still_watches_after_the_loop_waited_for_another_thread
    log = with_log do |io|
      NeverBlock.run(stall_threshold: 0.1) do
        queue = Thread::Queue.new
        loop_thread = Thread.current
        feeder = Thread.new do
          Thread.pass until loop_thread.status == "sleep" # the loop has parked: nothing else to do
          queue << :from_thread
        end
        assert_equal :from_thread, queue.pop
        feeder.join
        burn_cpu { io.string.include?(WARNING) }
      end
    end
    assert_equal 1, log.scan(WARNING).size, log
  end

  def test_global_setting_is_the_default_for_new_loops
    previous = NeverBlock.stall_threshold
    NeverBlock.stall_threshold = 5
    assert_equal 5.0, NeverBlock.stall_threshold
    assert_empty(with_log { NeverBlock.run { burn_cpu(0.4) { false } } })

    NeverBlock.stall_threshold = false
    assert_nil NeverBlock.stall_threshold
    assert_empty(with_log { NeverBlock.run { assert_empty detector_threads } })
  ensure
    NeverBlock.stall_threshold = previous
  end

  def test_global_setting_rejects_negative_nan_infinite_and_non_numeric_values
    previous = NeverBlock.stall_threshold
    [-0.1, Float::NAN, Float::INFINITY, "0.1"].each do |bad|
      error = assert_raises(ArgumentError, bad.inspect) { NeverBlock.stall_threshold = bad }
      assert_match(/stall_threshold must be a finite number of seconds >= 0/, error.message)
    end
    assert_equal previous, NeverBlock.stall_threshold, "a rejected value leaves the setting alone"
  end

  def test_run_rejects_a_negative_or_nan_threshold
    [-1, Float::NAN].each do |bad|
      assert_raises(ArgumentError, bad.inspect) { NeverBlock.run(stall_threshold: bad) { flunk "ran" } }
      assert_nil Fiber.scheduler, "no loop was left behind"
    end
  end

  def test_environment_variable_sets_the_default
    code = <<~RUBY
      require "neverblock"
      [nil, "", " 0.25 ", "2", "off", "OFF", "false", "no", "0", "abc", "-1", "nan", "1e400"].each do |text|
        text.nil? ? ENV.delete("NEVERBLOCK_STALL_THRESHOLD") : ENV["NEVERBLOCK_STALL_THRESHOLD"] = text
        NeverBlock.remove_instance_variable(:@stall_threshold) if NeverBlock.instance_variable_defined?(:@stall_threshold)
        result = begin
          NeverBlock.stall_threshold.inspect
        rescue ArgumentError => e
          "ArgumentError: \#{e.message}"
        end
        puts "\#{text.inspect} => \#{result}"
      end
    RUBY
    out, err, status = ruby_child("-e", code)
    assert status.success?, err
    parsed = out.lines.to_h { |line| line.chomp.split(" => ", 2) }
    assert_equal "0.1", parsed["nil"], "unset: 100 ms"
    assert_equal "0.1", parsed['""']
    assert_equal "0.25", parsed['" 0.25 "']
    assert_equal "2.0", parsed['"2"']
    %w[off OFF false no 0].each { |off| assert_equal "nil", parsed[off.inspect], off }
    assert_equal %(ArgumentError: NEVERBLOCK_STALL_THRESHOLD must be seconds or 'off', got "abc"), parsed['"abc"']
    assert_match(/\AArgumentError: NEVERBLOCK_STALL_THRESHOLD must be a finite number of seconds >= 0/, parsed['"-1"'])
    assert_match(/\AArgumentError: NEVERBLOCK_STALL_THRESHOLD must be/, parsed['"nan"'])
    assert_match(/\AArgumentError: NEVERBLOCK_STALL_THRESHOLD must be a finite number/, parsed['"1e400"'])
  end

  def test_environment_variable_reaches_the_loop
    code = <<~RUBY
      require "neverblock"
      require "stringio"
      log = StringIO.new
      NeverBlock.logger = Logger.new(log)
      clock = NeverBlock::Clock.method(:now)
      NeverBlock.run do
        started = clock.call
        nil until log.string.include?("#{WARNING}") || clock.call - started > ENV.fetch("BURN").to_f
      end
      print log.string
    RUBY
    out, err, status = ruby_child("-e", code, env: { "NEVERBLOCK_STALL_THRESHOLD" => "off", "BURN" => "0.4" })
    assert status.success?, err
    assert_empty out

    out, err, status = ruby_child("-e", code, env: { "NEVERBLOCK_STALL_THRESHOLD" => "0.05", "BURN" => "5" })
    assert status.success?, err
    assert_includes out, "stall threshold 50 ms"
  end

  # A loop with nothing to do but wait for another thread must not keep a
  # (timed) watchdog sleeping: Ruby would then never see the deadlock.
  def test_a_deadlocked_loop_still_dies_with_rubys_deadlock_error
    code = 'require "neverblock"; NeverBlock.run(stall_threshold: 0.1) { Thread::Queue.new.pop }'
    _, err, status = ruby_child("-e", code, env: { "NEVERBLOCK_STALL_THRESHOLD" => nil }, timeout: 30)
    refute status.success?
    assert_includes err, "No live threads left. Deadlock?"
  end

  private

  # Computes without yielding until the block returns true, or for at most
  # `limit` seconds.
  def burn_cpu(limit = 5)
    started = now
    nil until yield || now - started > limit
  end

  # @return [Float] the process's CPU seconds per wall second during the block
  def cpu_share
    cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
    started = now
    yield
    (Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) - cpu) / (now - started)
  end

  # Sends NeverBlock's log to a StringIO for the block.
  # @yieldparam io [StringIO]
  # @return [String] what was logged.
  def with_log
    io = StringIO.new
    previous = NeverBlock.logger
    NeverBlock.logger = Logger.new(io)
    yield io
    io.string
  ensure
    NeverBlock.logger = previous
  end

  def detector_threads
    Thread.list.select { |thread| thread.name == DETECTOR }
  end

  # Whether child `pid` has exited (a zombie until waited for), from /proc.
  def exited?(pid)
    File.read("/proc/#{pid}/stat")[/\) (\S)/, 1] == "Z"
  end
end
