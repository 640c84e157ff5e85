# frozen_string_literal: true

module NeverBlock
  class Server
    # How many connections of a backlog the {Acceptor} starts on the loop's
    # next turn. A turn is everything the loop ran between two of the
    # acceptor's looks: the connections it started last time, and the
    # streams and requests already open.
    #
    # - Up to {BATCH}: after a turn longer than {TURN}, the last count
    #   scaled down in proportion (at least {LEAST}); after a shorter one,
    #   twice the last count. A turn that started 64 Rails requests took
    #   150 ms; the next then started 10, and the one after that 64 again,
    #   every open stream's events waiting out each long turn.
    # - One a turn while the loop is saturated and late: its thread was on
    #   the CPU for {BUSY} of the last turns' time or more, and on each of
    #   the last two turns it was {LATE} late or more: the timers it fired
    #   (several each: the loop's scheduled work, see Timers#late), or, with
    #   {STREAMS} streamed responses open or more, its descriptors, left
    #   ready from turn to turn (Scheduler#io_late, on epoll).
    # - None for {HOLD} after the loop, with {STREAMS} streams open or
    #   more, left descriptors ready for {HOLD_LATE} or more on each of the
    #   last two turns, whatever its CPU share: it is that far behind, on
    #   its own work or because the machine's other processes take the CPU
    #   it would need (its share then falls as it falls behind). While it
    #   holds, a turn is a nap of {NAP}, not a yield: an acceptor taking a
    #   turn after every other made each event dearer.
    # - At most {STREAM_BATCH} a turn while {STREAMS} streamed responses or
    #   more are being written: each open stream's next event waits for
    #   all of a turn's starts.
    # - One a turn, each turn a nap of {NAP}, while {STREAMS} streamed
    #   responses or more are being written and the loop was busy for
    #   {BUSY} or more of the last {LOAD_WINDOW}: not waiting for IO or
    #   timers (Scheduler#idle_time), whether on the CPU or waiting for it.
    # - Whatever the pace, a connection held {WAIT} or longer; with
    #   {STREAMS} streams open, {STREAM_BATCH} of them a turn.
    #
    # Streams opened together would otherwise all be let in while the loop
    # has no CPU for their events: 2,000 streams of 20 events a second ask
    # 40,000 writes a second, more than one core makes on Ruby 3.1, and every
    # open stream's events then wait for turns that grow with each batch
    # started (worst gap p99 491 ms with all let in, 204-266 ms under the
    # turn-length rule alone, whose turns stay short while the loop has no
    # time left). Letting the backlog wait keeps the streams already open on
    # time, and those waiting start as others end; the loop stays busy
    # meanwhile, so no throughput is lost. Lateness is what tells streams
    # from a herd of short requests, which keeps a loop as busy but whose
    # timers are on time (no event is due): such a herd is let in {BATCH} a
    # turn, for every client to be served in turn. One whose requests wait
    # on timers of their own (short sleeps, polls) may be taken for streams:
    # {WAIT} bounds what that costs it.
    #
    # Relayed streams fire no timers: the upstream's events arrive as IO,
    # and a loop short of CPU reads them late, turn after turn, with more
    # descriptors ready than a selector call takes (2,000 relayed streams,
    # Ruby 3.1: worst gap p99 0.9-1.9 s with the timers alone telling
    # lateness, 0.33-0.74 s with the descriptors too). A herd of keep-alive
    # clients leaves as many descriptors ready (its next requests, and its
    # apps' queries and upstream calls), but answers each request whole:
    # descriptors count only while {STREAMS} streamed responses or more are
    # being written, and such a herd is let in {BATCH} a turn (1,000
    # clients of a hello world: p99 0.14-0.23 s; 1.0 s, with 450 of them
    # timing out, when descriptors counted for it).
    #
    # One a turn is not slow enough when turns are short: a loop behind on
    # its descriptors takes 64 a call, a turn of 2-3 ms, and one a turn let
    # 300-400 relayed streams a second in while the loop was a second
    # behind; and a single call that came back short of 64 ended the
    # lateness, and the count grew back to a whole batch within a few turns,
    # 150-200 streams let in at once (2,000 relayed streams, Ruby 3.4 +
    # YJIT: 1,600-1,700 open at the peak, worst gap p99 339-685 ms). The
    # hold keeps them out while the loop catches up (900-1,090 open, gap
    # 141-215 ms in interleaved rounds, 234-502 before; Falcon 0.57 beside
    # it: 120-136 ms). Their first events come later (p99 4.3-5.3 s, was
    # 2.2-2.6; Falcon's 4.0-5.4).
    #
    # A turn's starts delay every open stream. A start costs up to a
    # millisecond (a relay's first request, app call and connect to its
    # upstream). After each hold the count grew back to a whole batch within
    # a few turns: 2,000 relayed streams, Ruby 3.4 + YJIT, had 128 start
    # over two turns (one of 67 ms), and the 600 streams open then all saw
    # that stall. On Ruby 3.1, where 2,000 relayed streams take longer than
    # {WAIT} to start, the hundreds held that long started on one turn.
    # Interleaved rounds, 2,000 relayed streams, worst gap p99 with a few a
    # turn: 115-146 ms, was 161-280, on 3.4 + YJIT (Falcon 0.57 beside it:
    # 138-167); 105-139, was 133-244, on 3.1 (Falcon 0.51: 154-311). First
    # event p99 4.1-5.6 s, was 5.1-5.4; 5.3-6.3, was 5.0-5.5 (Falcon's
    # 5.9-7.4 and 3.7-5.6).
    #
    # The streams already open say what the loop can take: a stream's cost
    # comes with its events, after its start, when the turns that let it in
    # are past. Opened together, 2,000 Rails streams were all let in within
    # a second while the loop's timers were on time, and their events then
    # took the whole loop (Live's worst gap p99 up to 175 ms). Busy for
    # {BUSY} of its time, the loop lets in one a nap: at most some 200 a
    # second, as a busy app's new keep-alive clients need, far fewer than a
    # herd. Its idle time, not its thread's CPU time, tells: a process short
    # of CPU is busy, not idle. The starts count too: while the acceptor
    # takes turn after turn, the loop never waits, and the pace keeps a
    # fifth of its time idle, its own starts included. Interleaved rounds
    # against the code before, 2,000 streams, worst gap p99 at worst of
    # three: Live 124 ms, was 162, on Ruby 3.4 + YJIT (Falcon 0.57 beside
    # it: 161-219), 145, was 168, on 3.1 (Falcon 0.51: 166-252); Rails Rack
    # bodies 129, was 154; direct and relayed streams as before within the
    # runs' spread. First events come later (Live's p99 3.3-4.2 s, was
    # 1.9-2.7; Falcon's 8.2-10.7). With fewer streams open at once, fewer
    # events share a selector call, and each costs 10-25 % more CPU.
    class StartPace
      # Connections started a turn while turns take at most {TURN}.
      BATCH = 64

      # Streamed responses being written (Context#streams_open) from which
      # descriptors left ready count as lateness: more than a turn's batch.
      STREAMS = 64

      # Connections started a turn at most while {STREAMS} streamed
      # responses or more are being written (2 to 8 measured the same).
      STREAM_BATCH = 4

      # Seconds over which the loop's busy share is averaged (each turn
      # weighs its length): the share while streams are open says whether
      # the loop can take more.
      LOAD_WINDOW = 0.1

      # Seconds a turn may take before fewer start (a quarter of the
      # {StallDetector}'s default threshold: an event stream's next event is
      # due within a few of its 50 ms intervals).
      TURN = 0.025

      # Connections started a turn however long turns are, unless the loop
      # is saturated and late: a turn made long by something else (a major
      # GC, a request that computes) slows a herd's start, but does not
      # stall it.
      LEAST = 8

      # The share of the loop's time on the CPU (its thread's CPU time over
      # a turn's wall time, each turn's share averaged with the average
      # before it) from which a loop whose timers are late starts one
      # connection a turn; and its busy share (not idle, over
      # {LOAD_WINDOW}) from which, with {STREAMS} streams open, it starts
      # one a nap. Under it the loop
      # waits for IO or timers a fifth of its time, which absorbs the next
      # connections' start.
      BUSY = 0.8

      # Seconds the timers fired on each of the last two turns were late, at
      # the least, for the loop to count as late (a single late turn is a GC
      # or the idle sweeper's pass; see Timers#late).
      LATE = 0.002

      # Seconds descriptors were left ready (Scheduler#io_late) on each of
      # the last two turns from which none start for {HOLD}: a relayed
      # stream's events read 20 ms late or more.
      HOLD_LATE = 0.02

      # Seconds none start after the last turn {HOLD_LATE} late: a turn
      # whose selector call came back short of a batch does not end a hold
      # while the loop is still behind.
      HOLD = 0.2

      # Seconds a turn takes while the pace holds: the acceptor sleeps
      # instead of taking a turn after every other fiber's.
      NAP = 0.005

      # Seconds a held connection waits at most: past them it starts
      # whatever the pace (its client has waited that long for an answer).
      WAIT = 5.0

      # Seconds between two turns after which the second starts afresh (a
      # whole batch, nothing late or busy before it): a listener's pace
      # lasts from backlog to backlog (a backlog that fills again soon
      # after one emptied starts as the loop was doing), but turns that far
      # apart are not "the last two" (the loop ran many the pace did not
      # see). Longer than a {HOLD}, so that a hold and the turn after it
      # are one run.
      FRESH = 0.5

      # @param batch [Integer] see {BATCH}.
      # @param turn [Float] see {TURN}.
      # @param least [Integer] see {LEAST}.
      # @param busy [Float] see {BUSY}.
      # @param late [Float] see {LATE}.
      # @param streams [#call, nil] the streamed responses being written
      #   (Context#streams_open); nil: descriptors never count.
      # @param stream_batch [Integer] see {STREAM_BATCH}.
      def initialize(batch: BATCH, turn: TURN, least: LEAST, busy: BUSY, late: LATE, streams: nil,
                     stream_batch: STREAM_BATCH)
        @streams = streams
        @batch = batch
        @stream_batch = stream_batch
        @turn = turn
        @least = least
        @busy_at = busy
        @late_at = late
        afresh # @busy, @late, @io_late, @count, @load
        @hold_until = nil # (Clock.now) none start before it
        @turned_at = nil # (Clock.now) when the last turn ended
      end

      # Lets `scheduler`'s loop take a turn (while the pace holds, or the
      # loop is busy with {STREAMS} streams open, naps {NAP} instead),
      # timing it (wall clock, the loop's thread's CPU and idle time, how
      # late its timers and, with {STREAMS} streams open or more after it,
      # its descriptors were). Called by Acceptor#start_held, from the loop.
      # @return [Integer] how many connections to start after it ({#after}),
      #   at most {STREAM_BATCH} with {STREAMS} streams open or more, and
      #   one while the loop is also busy for {BUSY} of its time.
      def turn(scheduler)
        began = Clock.now
        cpu = thread_cpu
        idle = scheduler.idle_time
        holding?(began) || (loaded? && streaming?) ? sleep(NAP) : scheduler.yield
        spent = thread_cpu
        late = scheduler.timers_late
        io_late = 0.0
        streaming = streaming?
        if streaming
          io_late = scheduler.io_late
          late = io_late if io_late > late
        end
        count = after(Clock.now - began, (spent - cpu if cpu && spent && spent >= cpu), late, io_late,
                      scheduler.idle_time - idle)
        return count unless streaming

        [count, loaded? ? 1 : @stream_batch].min
      end

      # @param since [Array<Float>] when each held connection was taken in,
      #   oldest first ({Clock.now}).
      # @return [Integer] how many of them waited {WAIT} or longer: they
      #   start, whatever the pace; at most {STREAM_BATCH} while {STREAMS}
      #   streams or more are open (a herd held that long is one
      #   the loop could not keep up with: 2,000 relayed streams on Ruby 3.1
      #   had hundreds start on one turn at 5 s, and every open stream's
      #   worst gap grew to 0.4 s).
      def overdue(since)
        cutoff = Clock.now - WAIT
        count = since.index { |at| at > cutoff } || since.size
        streaming? ? [count, @stream_batch].min : count
      end

      # @param took [Float] seconds the loop's last turn took.
      # @param cpu [Float, nil] CPU seconds the loop's thread spent in it.
      # @param late [Float] how late the loop was in it: the most seconds a
      #   timer fired late, or descriptors were left ready.
      # @param io_late [Float] how long descriptors were left ready
      #   (Scheduler#io_late, with {STREAMS} open or more; else 0.0).
      # @param idle [Float, nil] seconds the loop waited in it with nothing
      #   to run (Scheduler#idle_time); nil: not known.
      # @return [Integer] how many to start now: 0 to {BATCH}.
      def after(took, cpu = nil, late = 0.0, io_late = 0.0, idle = nil)
        now = Clock.now
        afresh if @turned_at && now - took - @turned_at > FRESH
        @turned_at = now
        if idle && took.positive?
          load = 1.0 - (idle / took).clamp(0.0, 1.0)
          @load += (load - @load) * [took / LOAD_WINDOW, 1.0].min
        end
        lately = [late, @late].min
        @late = late
        @hold_until = now + HOLD if [io_late, @io_late].min >= HOLD_LATE
        @io_late = io_late
        if holding?(now)
          @count = @least # when the hold ends, a whole batch after a few turns
          return 0
        end
        if cpu && took.positive?
          busy = (cpu / took).clamp(0.0, 1.0)
          @busy = @busy ? (@busy + busy) / 2 : busy
          if @busy >= @busy_at && lately >= @late_at
            @count = @least # when the loop has time again, a whole batch after a few turns
            return 1
          end
        end
        @count = if took <= @turn then (@count * 2).clamp(@least, @batch)
                 else (@count * @turn / took).floor.clamp(@least, @batch)
                 end
      end

      private

      # What the pace knows of the loop, forgotten: a whole batch next.
      def afresh
        @busy = nil # the average share of time on the CPU, over the turns so far
        @late = 0.0 # the last turn's lateness
        @io_late = 0.0 # the last turn's descriptors' lateness
        @count = @batch # what the last call answered
        @load = 0.0 # the loop's busy share of the last LOAD_WINDOW, about
      end

      def holding?(now)
        @hold_until && now < @hold_until
      end

      # Whether the loop was busy (not waiting for IO or timers) for
      # {BUSY} of the last {LOAD_WINDOW} or more.
      def loaded?
        @load >= @busy_at
      end

      # Whether {STREAMS} streamed responses or more are being written.
      def streaming?
        @streams && @streams.call >= STREAMS
      end

      # @return [Float, nil] CPU seconds of the loop's thread (nil where the
      #   clock cannot be read).
      def thread_cpu
        Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID)
      rescue SystemCallError
        nil
      end
    end
  end
end
