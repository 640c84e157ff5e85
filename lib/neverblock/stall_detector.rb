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
  #
  # A C call that keeps the GVL (an SQLite query, a compression, a regexp
  # over a large string) stops the watchdog too: it samples nothing until
  # the call returns. It then wakes late, and that lateness is the stall: when
  # it woke at least the threshold plus Ruby's thread timeslice late (any busy
  # loop delays it by up to a timeslice; a timeslice for each other thread
  # that wants to run) and the process spent at least a quarter of that time
  # on the CPU (so it was not merely waiting for a core on a busy machine),
  # it reports a stall. On Ruby 3.1 and 3.2, which hand it the GVL as the
  # call returns, with the fiber's backtrace taken at once: where the call
  # returned to, with its callers. Ruby 3.3+ hands the GVL over a timeslice
  # later or at the next wait; there the backtrace is shown only when no
  # other fiber ran since the watchdog's last look. Else the fiber running
  # when it woke is looked at once more: still running with no switch, it
  # is reported as any fiber holding the loop (a Ruby loop that kept the
  # GVL past its timeslice on a busy machine); if it switched, one line says
  # how long the GVL was held. A C call that keeps the GVL while it waits
  # without CPU (a sleep in C, such as SQLite's own busy timeout) goes
  # unreported.
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
      @seen = @since = @reported = @unexplained = nil
      until @stopping
        @lock.synchronize { @cond.wait(@lock) while @idle && !@stopping }
        asleep_at = Clock.now
        cpu_before = cpu_time
        sleep @interval
        running = @scheduler.running
        switches = @scheduler.switches
        now = Clock.now
        late = now - asleep_at - @interval
        look(running, switches, now, late, cpu_time - cpu_before >= late / 4) # else it waited for a CPU
      end
      report_gvl_hold(@unexplained) if @unexplained
    end

    # One look at the loop: `running` (a fiber, or nil while the loop waits)
    # and its `switches` count at `now`, the watchdog having woken `late`
    # seconds late; `ran` false when the process hardly used a CPU
    # meanwhile (a busy machine, SIGSTOP), so the lateness was no fiber's.
    #
    # A late wake after a switch, with a fiber running (Ruby 3.3+), is held
    # over one look (@unexplained): the fiber still running then, with no
    # switch, held the loop itself (a Ruby busy loop that kept the GVL past
    # its timeslice on a loaded machine) and is reported with its backtrace
    # once it passes the threshold; if it switched, the hold was a call that
    # kept the GVL and had ended.
    def look(running, switches, now, late, ran)
      if @unexplained && (running.nil? || switches != @seen)
        report_gvl_hold(@unexplained)
        @unexplained = nil
      end
      if late >= @threshold + TIMESLICE && @reported != switches && ran && late >= @threshold + TIMESLICE * busy_threads
        # On 3.3+ a fiber that ran since the last look may have made the
        # call and yielded: the one running now is not known to be it.
        if running && (GVL_AT_RETURN || switches == @seen)
          @unexplained = nil
          @reported = switches
          report(running, late, gvl: true)
        elsif running
          @unexplained = late
        else
          @reported = switches
          report_gvl_hold(late)
        end
        @seen = switches
        @since = now
      elsif running.nil? || switches != @seen
        @seen = switches
        @since = now
      else
        @since += late if late.positive? && !ran # the time the process did not run is no fiber's
        if @reported != switches && now - @since >= @threshold
          @reported = switches
          @unexplained = nil
          report(running, now - @since)
        end
      end
    end

    # Seconds a thread that wants the GVL may wait while another runs Ruby
    # code (Ruby's thread timeslice, 100 ms; RUBY_THREAD_TIMESLICE in
    # milliseconds from Ruby 3.4): a busy loop that yields often wakes the
    # watchdog this late.
    TIMESLICE = (RUBY_VERSION >= "3.4" && Integer(ENV.fetch("RUBY_THREAD_TIMESLICE", 100), exception: false)&.fdiv(1000)) || 0.1
    # Whether a thread in a C call that keeps the GVL gives it to a waiting
    # thread as soon as the call returns (Ruby 3.1 and 3.2), so that the
    # watchdog's backtrace shows where the call returned to.
    GVL_AT_RETURN = RUBY_ENGINE == "ruby" && RUBY_VERSION < "3.3"
    private_constant :TIMESLICE, :GVL_AT_RETURN

    # Threads besides this one that want to run (CPU work in NeverBlock.defer,
    # say): each may hold the GVL a timeslice before the watchdog gets it.
    def busy_threads
      [Thread.list.count { |thread| !thread.equal?(Thread.current) && thread.status == "run" }, 1].max
    end

    # Seconds of CPU this process has used (all its threads).
    def cpu_time
      Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
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
    # A call that kept the GVL ended before the watchdog could look, and the
    # loop was waiting by then: Ruby 3.3+ hands the GVL over only after
    # another timeslice of Ruby or at the next wait, by when a fiber that
    # made the call has usually yielded. No backtrace can show it.
    def report_gvl_hold(held)
      @stalls += 1
      NeverBlock.logger.warn("NeverBlock") do
        "Ruby's GVL was held for at least #{(held * 1000).round} ms by a call that kept it (C code: a SQLite " \
          "query, a compression...; in a fiber of this loop or in another thread) (stall threshold " \
          "#{(@threshold * 1000).round} ms); this event loop could not run meanwhile. It had ended when this " \
          "watchdog could look, so there is no backtrace. NeverBlock.defer { } moves such a call off the loop " \
          "only where the C code releases the GVL."
      end
    end

    # With `gvl:` the stall was a call that kept the GVL (the watchdog woke
    # `held` seconds late) and the backtrace shows where it returned to.
    def report(fiber, held, gvl: false)
      @stalls += 1
      backtrace = @scheduler.thread.backtrace || []
      task = @scheduler.tasks.find { |candidate| candidate.fiber.equal?(fiber) }
      summary = "#{task ? task.inspect : fiber.inspect} has held the event loop for at least " \
                "#{(held * 1000).round} ms without yielding (stall threshold #{(@threshold * 1000).round} ms)"
      if gvl
        summary += ", in a call that kept Ruby's GVL (C code: a SQLite query, a compression...), " \
                   "#{GVL_AT_RETURN ? 'which returned to the first frame shown' : 'and is now at the first frame shown (Ruby 3.3+ hands the watchdog the GVL up to a timeslice of Ruby after the call)'}"
      end
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
