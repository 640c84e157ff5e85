# frozen_string_literal: true

module NeverBlock
  class Server
    # Holds Ruby's major GCs off while a herd of connections starts (Ruby
    # 3.4+, `GC.config(rgengc_allow_full_mark: false)`), so that Ruby grows
    # its heap for the herd instead of marking all of it to make room.
    #
    # A server's heap after boot holds little more than the app
    # ({HeapWarmup} frees the empty pages), and a herd of streams makes
    # Ruby grow it. Past the first two minor GCs after a major one, Ruby
    # grows a heap only through another major GC, which with thousands of
    # fibers open takes about 100 ms, and every open stream waits for it:
    # 2,000 Live streams opened at once on Ruby 3.4 + YJIT took one or two
    # of them (157-286 ms of GC against 58-65 for the same streams as Rack
    # bodies), and their first event p99 was up to twice a Rack body's.
    # With full marking off Ruby grows the heap at the minor GC instead.
    #
    # The hold begins when the {Acceptor}, the listener's only worker,
    # takes in a backlog of {Acceptor::BATCH} connections or more on one
    # turn ({Acceptor#start_held}, a herd), and ends {AFTER} after the
    # herd's last connection started (its streams' first events allocate
    # the most), {LONGEST} after it began at the latest, when the server's
    # loop ends (a stop, or an exception), or in a forked child. A server
    # of several workers sharing a listener holds nothing: each takes its
    # share of a backlog, not the herd. After a hold none begins for {REST}: a
    # server taking in herd after herd (new connections for every request)
    # does its major GCs between them. What the hold left for the old
    # generation is collected by the next major GC that Ruby's own limits
    # ask for once it ended.
    #
    # It holds nothing where Ruby has no such setting (before 3.4) or the
    # environment says `NEVERBLOCK_HERD_GC=off`, and leaves full marking
    # alone where the app turned it off itself (out-of-band GC): the hold
    # only begins while full marking is on (an app that turns it off during
    # a hold finds it on again at the hold's end).
    # GC.config is the whole process's; so is the hold (one at a time).
    module HerdGC
      # How long a hold lasts after the herd's last connection started.
      AFTER = 1.0
      # The longest a hold lasts, however long its herds take to start.
      LONGEST = 5.0
      # After a hold, how long none begins.
      REST = 30.0

      @held_at = nil # when the hold began (Clock.now), nil while none
      @released_at = nil
      @herds = 0 # herds starting now (one per listener at most)
      @last_started = nil # when the last herd's last connection started

      class << self
        # @return [Boolean] whether herds hold major GCs off here: this
        #   Ruby lets a process turn full marking off (GC.config's
        #   `rgengc_allow_full_mark`, Ruby 3.4+), and the environment does
        #   not say `NEVERBLOCK_HERD_GC=off`.
        def supported?
          return @supported unless @supported.nil?

          @supported = ENV["NEVERBLOCK_HERD_GC"] != "off" && GC.respond_to?(:config) &&
                       GC.config.key?(:rgengc_allow_full_mark)
        end

        # @api private
        # Forgets what {.supported?} found (a test changes the environment).
        # @return [void]
        def recheck
          @supported = nil
        end

        # @return [Boolean] whether major GCs are held off now.
        def holding?
          !@held_at.nil?
        end

        # A herd begins to start ({Acceptor#start_held}): holds major GCs
        # off unless a hold ended less than {REST} ago, or full marking is
        # off already. Its end is then timed on `scheduler`'s loop.
        # @param scheduler [Scheduler]
        # @return [void]
        def herd_starting(scheduler)
          @herds += 1
          return if @held_at || !supported?

          now = Clock.now
          return if @released_at && now - @released_at < REST
          return unless GC.config[:rgengc_allow_full_mark]

          @held_at = now
          @last_started = nil
          GC.config(rgengc_allow_full_mark: false)
          scheduler.add_timer(LONGEST, method(:release_if_due))
        end

        # The herd's connections have all started (or it was cancelled):
        # the hold ends {AFTER} from now, unless another herd starts.
        # @param scheduler [Scheduler]
        # @return [void]
        def herd_started(scheduler)
          @herds -= 1 if @herds.positive?
          return unless @held_at && @herds.zero?

          @last_started = Clock.now
          scheduler.add_timer(AFTER, method(:release_if_due))
        end

        # A timer's look: ends the hold once {AFTER} passed since the last
        # herd started with no herd starting now, or {LONGEST} since it
        # began.
        # @return [void]
        def release_if_due(_argument = nil)
          return unless @held_at

          now = Clock.now
          due = now - @held_at >= LONGEST || (@herds.zero? && @last_started && now - @last_started >= AFTER)
          release if due
        end

        # Ends the hold now (if there is one): full marking back on.
        # @return [void]
        def release
          return unless @held_at

          @held_at = nil
          @last_started = nil
          @released_at = Clock.now
          GC.config(rgengc_allow_full_mark: true)
        end

        # The end of a server's loop, or a forked child: ends any hold,
        # and forgets the herds starting (the child serves none of them)
        # and the last hold's {REST}.
        # @return [void]
        def reset
          @herds = 0
          release
          @released_at = nil
        end
      end

      NeverBlock.on_fork_child { reset }
    end
  end
end
