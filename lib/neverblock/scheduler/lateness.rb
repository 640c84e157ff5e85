# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # How far behind the loop is: its timers' lateness, and how long its
    # selector's calls have been leaving ready descriptors for later turns.
    #
    # Who calls it, and when:
    # - Server::StartPace, from the loop, after each turn it lets the loop
    #   take while it holds a backlog of connections ({#timers_late},
    #   {#io_late});
    # - Scheduler#run_once, every turn, with what the selector's call
    #   reported (#selected; parking resets @io_behind_since itself), and
    #   the time it waited (@idle: the selector's idle_duration, or the
    #   time parked);
    # - Scheduler#initialize, once (#full_select).
    #
    # State it shares with the core: @timers, @selector_class; its own:
    # @select_full, @io_behind_since, @idle. Loop's thread only; no locks, and
    # nothing allocated per turn.
    module Lateness
      # The most events one call of io-event's EPoll and KQueue selectors
      # reports (their EPOLL_MAX_EVENTS and KQUEUE_MAX_EVENTS): a call that
      # reports as many has left others ready for the next turn. Its
      # io_uring and select selectors take all that are ready, every
      # completion and wake-up included.
      SELECT_BATCH = { "EPoll" => 64, "KQueue" => 64 }.freeze
      private_constant :SELECT_BATCH

      # @api private
      # @return [Float] how late the loop's last turn fired its timers
      #   ({Timers#late}).
      def timers_late
        @timers.late
      end

      # @api private
      # @return [Float] the age of the run of full selector calls the last
      #   one belongs to ({SELECT_BATCH}: each reported as many descriptors
      #   as a call takes, and left others ready for the next turn), 0.0
      #   when the last call was not full, and always with the select and
      #   io_uring selectors, which take every ready descriptor in one call.
      #   While calls come back full, more descriptors are ready than a turn
      #   takes, and each waits a turn or more for its fiber to run: a loop
      #   relaying a thousand upstream streams reads each a second late
      #   while all its timers are on time. The age says how long that has
      #   lasted, not how long any one descriptor waited.
      def io_late
        @io_behind_since ? Clock.now - @io_behind_since : 0.0
      end

      # @api private
      # @return [Float] seconds the loop has spent blocked, with nothing to
      #   run, waiting for IO, timers or a wake-up, since it began: its idle
      #   time (the selector's own measure of each call's wait, which leaves
      #   out the fibers the call runs). Wall time between two readings,
      #   less their difference, is the loop's busy time: running fibers, or
      #   ready to and waiting for the CPU (a process short of CPU looks idle
      #   by its thread's CPU time, and busy by this, but for the moment a
      #   woken wait takes to get the CPU back). io-event's select(2)
      #   selector times only waits with a deadline: there a wait for IO
      #   with no timer due counts none (Server::StartPace's naps have one).
      def idle_time
        @idle
      end

      private

      # @return [Integer, nil] what a call of `selector_class` reports when
      #   it leaves descriptors ready for the next turn; nil for selectors
      #   that take all that are ready.
      def full_select(selector_class)
        SELECT_BATCH[selector_class.name.split("::").last]
      end

      # The selector's call reported `count` events (an Integer; anything
      # else counts as none).
      def selected(count)
        if @select_full && count.to_i >= @select_full
          @io_behind_since ||= Clock.now
        else
          @io_behind_since = nil
        end
      end
    end
  end
end
