# frozen_string_literal: true

module NeverBlock
  # Answers "what is blocking my reactor?": a watchdog thread that notices
  # when one fiber has held the event loop longer than a threshold without
  # yielding, and logs one warning naming the task and showing where it is.
  #
  # The loop itself pays almost nothing: entering a fiber bumps a counter
  # (Scheduler#switches) and records the fiber (Scheduler#running). The
  # watchdog samples both every quarter threshold; when the same fiber has
  # been running with no switch for the threshold, it logs the loop thread's
  # backtrace (which is the stalled fiber's). A stall is reported once; a
  # backtrace at most once a minute, the stalls in between in one line.
  #
  # Ruby hands the GVL to the watchdog only at its thread-switch points (every
  # 100 ms, or when C code releases the GVL), so stalls shorter than about
  # the threshold plus that may go unreported; long ones never do.
  class StallDetector
    # @return [Float] seconds a fiber may hold the loop before a warning.
    attr_reader :threshold

    # @return [Integer] stalls reported so far.
    attr_reader :stalls

    # @param scheduler [Scheduler]
    # @param threshold [Numeric] seconds.
    def initialize(scheduler, threshold)
      @scheduler = scheduler
      @threshold = threshold.to_f
      @interval = [@threshold / 4, 0.005].max
      @lock = Thread::Mutex.new
      @cond = Thread::ConditionVariable.new
      @idle = false
      @thread = nil
      @stopping = false
      @stalls = 0
    end

    # Starts the watchdog thread (once).
    # @return [void]
    def start
      return if @thread || @stopping

      @thread = Thread.new { watch }
      @thread.name = "neverblock-stall-detector"
      @thread.report_on_exception = true
    end

    # Runs the block (the loop waiting for another thread, with nothing to
    # run) while the watchdog waits too: a watchdog sleeping with a timeout
    # would hide a deadlock from Ruby's deadlock detector.
    # @api private
    def idle
      @lock.synchronize { @idle = true }
      yield
    ensure
      @lock.synchronize do
        @idle = false
        @cond.signal
      end
    end

    # Stops and joins the watchdog thread.
    # @return [void]
    def stop
      @lock.synchronize do
        @stopping = true
        @cond.signal
      end
      return unless @thread

      @thread.wakeup if @thread.alive?
      @thread.join
    rescue ThreadError
      @thread.join # it went to sleep between alive? and wakeup
    end

    private

    def watch
      seen = nil
      since = nil
      reported = nil
      until @stopping
        @lock.synchronize { @cond.wait(@lock) while @idle && !@stopping }
        sleep @interval
        running = @scheduler.running
        switches = @scheduler.switches
        now = Clock.now
        if running.nil? || switches != seen
          seen = switches
          since = now
        elsif reported != switches && now - since >= @threshold
          reported = switches
          report(running, now - since)
        end
      end
    end

    # Seconds after a report with a backtrace during which further stalls
    # are logged in one line each (a development server's file watcher, say,
    # stalls on every request).
    QUIET_PERIOD = 60
    # The most frames a report shows (a Rails request's stack has hundreds).
    SHOWN_FRAMES = 40
    private_constant :QUIET_PERIOD, :SHOWN_FRAMES

    # A stall is logged with its backtrace, at most once a QUIET_PERIOD;
    # the ones in between in one line each, naming the innermost frame.
    def report(fiber, held)
      @stalls += 1
      backtrace = @scheduler.thread.backtrace || []
      task = @scheduler.tasks.find { |candidate| candidate.fiber.equal?(fiber) }
      summary = "#{task ? task.inspect : fiber.inspect} has held the event loop for at least " \
                "#{(held * 1000).round} ms without yielding (stall threshold #{(@threshold * 1000).round} ms)"
      now = Clock.now
      if @shown_at && now - @shown_at < QUIET_PERIOD
        @quiet += 1
        NeverBlock.logger.warn("NeverBlock") do
          "#{summary} at #{backtrace.first}; #{@quiet} such report(s) in one line since the last backtrace"
        end
        return
      end
      @shown_at = now
      @quiet = 0
      NeverBlock.logger.warn("NeverBlock") do
        shown = backtrace.first(SHOWN_FRAMES)
        shown << "... #{backtrace.size - SHOWN_FRAMES} more" if backtrace.size > SHOWN_FRAMES
        "#{summary}; everything else on this loop waits meanwhile. Move CPU work or blocking C calls into " \
          "NeverBlock.defer { }. It is here:\n  #{shown.join("\n  ")}"
      end
    end
  end
end
