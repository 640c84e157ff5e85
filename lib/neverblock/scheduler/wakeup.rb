# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # The cross-thread wake-up: how another thread hands the loop work and
    # gets it to look, whatever the loop is doing at that moment.
    #
    # Holds the inbox (a Thread::Queue of items for the loop), a pipe that
    # wakes the loop out of its selector, the internal fiber that watches
    # that pipe, and parking (the loop's wait when only another thread can
    # give it work).
    #
    # Who calls it, and when:
    # - any other thread: {#push}, through Scheduler#post (thread-pool jobs,
    #   Task#cancel from another thread) and Scheduler#unblock (a Mutex or
    #   Queue released by another thread);
    # - the loop's thread: Scheduler#bind_thread ({#bind}), Scheduler#run_loop
    #   ({#start_watching} and {#stop_watching} around the outermost loop),
    #   Scheduler#run_once ({#park}; it also reads and drains {#inbox}
    #   directly, the check it makes every turn), Scheduler#close ({#close})
    #   and a forked child's Scheduler#forked_close ({#close_forked}).
    #
    # What the items in the inbox mean is the scheduler's business
    # (Scheduler#drain_inbox); this object only carries them and wakes.
    #
    # Why a pipe: Selector#wakeup does nothing unless the selector is already
    # blocked, so a wake-up that comes just before the loop blocks is lost; a
    # byte in a pipe is not. At most one byte is in flight per wake-up
    # ({#push} writes only when none is pending).
    #
    # Locking: none of its own. The inbox and the park queue are
    # Thread::Queues; the flags other threads read (@parked, @pending) are
    # each written before the queue operation they guard, so a wake-up
    # racing the loop is either seen by the loop's own check of the inbox or
    # wakes it (see {#park}); a lost race costs at most one extra byte.
    class Wakeup
      # @return [Thread::Queue] items posted for the loop. Other threads add
      #   to it with {#push}; the loop's thread may add to it directly (it
      #   needs no waking), and reads and drains it.
      attr_reader :inbox

      def initialize
        @inbox = Thread::Queue.new
        @reader, @writer = IO.pipe
        @pending = false # a byte is in the pipe, not yet read by the watcher
        @parked_wake = Thread::Queue.new # wakes #park
        @parked = false
        @watcher = nil
        @watching = false # the watcher waits in the selector (the loop runs)
        @closed = false
        @selector = nil
        @loop = nil
      end

      # Loop's thread. Creates the watcher fiber for `selector`, whose loop
      # runs in `loop_fiber`; a watcher bound before (to a scheduler moved
      # to another thread) is abandoned where it waits, outside any selector.
      # Called while a fiber stack can surely be had; the watcher waits on
      # the pipe only between {#start_watching} and {#stop_watching}.
      # @return [void]
      def bind(selector, loop_fiber)
        @selector = selector
        @loop = loop_fiber
        @watcher = Fiber.new(blocking: false) { watch }
        @watcher.transfer
      end

      # Any thread other than the loop's. Queues `item` for the loop and
      # wakes it: out of the selector, or out of {#park}.
      # @return [void]
      def push(item)
        @inbox << item
        @parked_wake << true if @parked
        return if @pending

        @pending = true
        @writer.write_nonblock(".", exception: false)
      rescue IOError
        nil # closed: the loop is gone
      end

      # Loop fiber only, when the outermost loop starts: the watcher waits
      # on the pipe in the selector.
      # @return [void]
      def start_watching
        switch(true)
      end

      # Loop fiber only, when the outermost loop ends: the watcher leaves
      # the selector (a scheduler dropped without Scheduler#close must hold
      # no fiber in its selector, see Scheduler.strand). A byte left in the
      # pipe waits for the next loop.
      # @return [void]
      def stop_watching
        switch(false)
      end

      # Loop fiber only. Nothing can happen on the loop's thread (no IO, no
      # timers, nothing ready): waits until another thread {#push}es. A
      # Thread::Queue lets Ruby's deadlock detector see the wait when no
      # such thread exists.
      # @param stall_detector [StallDetector, nil] told the loop is idle, not
      #   stalled, meanwhile.
      # @return [void]
      def park(stall_detector)
        @parked = true
        if stall_detector
          stall_detector.idle { @parked_wake.pop if @inbox.empty? }
        elsif @inbox.empty?
          @parked_wake.pop
        end
      ensure
        @parked = false
        @parked_wake.clear
      end

      # Loop fiber only, before the selector is closed: ends the watcher and
      # closes the pipe. Pushes after this are dropped.
      # @return [void]
      def close
        @closed = true
        @watcher.transfer if @watcher.alive? # it sees @closed and ends
        close_pipe
      end

      # In a forked child: closes the child's copy of the pipe. The parent's
      # watcher fiber stays where it waits in the selector's copy: nothing in
      # the child may resume it.
      # @return [void]
      def close_forked
        @closed = true
        close_pipe
      end

      private

      # The watcher fiber's body: while the loop runs, wait in the selector
      # for a byte and read it (the selector's return is the wake-up);
      # between loops, wait outside it, in a transfer back to the loop.
      def watch
        watcher = Fiber.current
        until @closed
          if @watching
            @selector.io_wait(watcher, @reader, IO::READABLE)
            next unless @watching # switched off: a byte left in the pipe waits for the next loop

            # Read, then clear: a push between the two finds @pending set and
            # writes nothing, but its item is in the inbox, which the loop checks
            # before it waits again. Cleared first, a byte pushed in between
            # would be read with this one and leave @pending set over an empty
            # pipe: no later push would write one, and the loop would sleep
            # through them all.
            @reader.read_nonblock(4096, exception: false)
            @pending = false
          else
            @loop.transfer
          end
        end
      end

      # Called from the loop fiber, where the watcher is always parked in one
      # place or the other: resumed, its wait returns (which unlinks it from
      # the selector) and it parks in the other place, handing control back.
      def switch(on)
        @watching = on
        @watcher.transfer if @watcher.alive?
      end

      def close_pipe
        @reader.close
        @writer.close
      end
    end
  end
end
