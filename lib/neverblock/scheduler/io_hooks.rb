# frozen_string_literal: true

module NeverBlock
  class Scheduler
    # The IO hooks of Fiber::Scheduler: how a fiber waits on a descriptor
    # (io_wait, io_read, io_write, io_pread, io_select), and how a fiber
    # waiting on an IO that gets closed under it is told so (io_close, and
    # before Ruby 4.0 the close watch).
    #
    # Who calls it, and when: Ruby, from a non-blocking fiber on the
    # scheduler's thread, whenever that fiber's IO would block (io_close:
    # whenever a descriptor is closed on that thread). Inside NeverBlock,
    # Scheduler#process_wait waits in the selector through #in_selector too,
    # and Scheduler#offload uses #without_hooks.
    #
    # Contracts:
    # - Every wait goes through #in_selector, the hot path of all IO: it
    #   lets a fiber woken by Scheduler#wake_next run first, then starts the
    #   wait's timer (in that order), counts the fiber in @io_waiting (the
    #   loop blocks in the selector rather than parking while any fiber
    #   waits there) and records it in @waits as waiting on `io`, which is
    #   how the close watch, IO#timeout and Scheduler#interrupt_fiber's
    #   `still` checks know what it waits on.
    # - A timeout given to io_wait makes it return false; IO#timeout raises
    #   IO::TimeoutError in the fiber instead (Scheduler::Interrupts).
    # - Loop's thread only; no locks.
    #
    # State it shares with the core (set up in Scheduler#initialize):
    # @selector, @timers, @waits, @io_waiting, @running, @switches; its own:
    # @wait_deadlines (a timeout's timer, WaitDeadlines), @close_watch,
    # @close_sweep.
    module IOHooks
      # Fiber::Scheduler hook: wait until `io` is ready for `events`.
      # An explicit `timeout` (seconds) makes it return false; IO#timeout
      # raises IO::TimeoutError instead (#in_selector starts either timer).
      # @return [Integer, false] the ready events, false on timeout.
      def io_wait(io, events, timeout = nil)
        return events if File === io && (events & IO::PRIORITY).zero? && always_ready?(io)

        fiber = Fiber.current
        in_selector(fiber, io, "ready", timeout) { @selector.io_wait(fiber, io, events) }
      end

      if IO.const_defined?(:Buffer)
        # Fiber::Scheduler hook: read at least `length` bytes into `buffer`.
        # @return [Integer] bytes read, or a negated errno.
        def io_read(io, buffer, length, offset = 0)
          fiber = Fiber.current
          in_selector(fiber, io, "readable") { @selector.io_read(fiber, io, buffer, length, offset) }
        end

        # Ruby 3.3.0's io_write hook miscomputes lengths; it is fixed in 3.3.1.
        if RUBY_ENGINE != "ruby" || RUBY_VERSION < "3.3" || RUBY_VERSION >= "3.3.1"
          # Fiber::Scheduler hook: write at least `length` bytes from `buffer`.
          # @return [Integer] bytes written, or a negated errno.
          def io_write(io, buffer, length, offset = 0)
            fiber = Fiber.current
            in_selector(fiber, io, "writable") { @selector.io_write(fiber, io, buffer, length, offset) }
          end
        end
      end

      if IO.const_defined?(:Buffer)
        # Fiber::Scheduler hook: `IO#pread` (and IO::Buffer#pread), reading
        # at least `length` bytes at file position `from` into `buffer` at
        # `offset`. With the io_uring selector the read is asynchronous; with
        # epoll (which cannot wait on regular files) it is the same pread(2)
        # Ruby would make, waiting on the descriptor only when it would block.
        # @return [Integer] bytes read, or a negated errno.
        def io_pread(io, buffer, from, length, offset)
          fiber = Fiber.current
          if @selector.respond_to?(:io_pread)
            return in_selector(fiber, io) { @selector.io_pread(fiber, io, buffer, from, length, offset) }
          end

          positioned_io(io, length, buffer.size - offset, IO::READABLE) do |done, chunk|
            if BUFFER_POSITIONED_IO
              buffer.pread(io, from + done, chunk, offset + done)
            else
              data = io.pread(chunk, from + done)
              buffer.set_string(data, offset + done)
              data.bytesize
            end
          end
        end

        # IO::Buffer#pread(io, from, length, offset), Ruby 3.3+: straight into
        # the hook's buffer, no copy.
        #
        # There is deliberately no io_pwrite hook: with any scheduler that
        # defines it, Ruby's own reference scheduler included, a thread that
        # called IO#pwrite through it spins forever when it exits (Ruby 3.3.8
        # and 3.4.11). Without the hook, IO#pwrite makes the same pwrite(2)
        # itself.
        BUFFER_POSITIONED_IO = RUBY_VERSION >= "3.3"
        private_constant :BUFFER_POSITIONED_IO
      end

      # Fiber::Scheduler hook (Ruby 4.0+; 3.3 and 3.4 have the call disabled):
      # `fd` is being closed by this thread.
      # Fibers of this loop still waiting on it get IOError ("stream closed in
      # another thread") on the loop's next turn, as a thread would, instead of
      # waiting on a descriptor epoll has silently dropped. Ruby then closes
      # the descriptor itself (a falsy return says so).
      # @return [nil]
      def io_close(_fd)
        post(@close_sweep) if @io_waiting.positive? && !@closed
        nil
      end

      # Fiber::Scheduler hook (Ruby 3.2+): `IO.select` from a fiber; on Ruby
      # 3.1, which has no such hook, `require "neverblock/io_select"` calls it.
      # @return [Array, nil] like IO.select.
      #
      # Polls; if nothing is ready, one watcher fiber per IO waits in the
      # selector, the first to fire wakes this fiber, the watchers are
      # stopped and it polls again (another fiber may have taken the data).
      # The poll is Ruby's own select with a zero timeout, so the arguments
      # are checked, and data already in an IO's Ruby buffer counts, as
      # IO.select does. The timeout reaches the hook unchecked: checked here
      # as IO.select checks it (a negative one returned nil at once).
      def io_select(readables, writables = nil, exceptables = nil, timeout = nil)
        unless timeout.nil?
          raise TypeError, "can't convert #{timeout.class} into time interval" unless timeout.is_a?(Numeric)
          raise RangeError, "NaN out of Time range" if timeout.is_a?(Float) && timeout.nan?
          raise ArgumentError, "time interval must not be negative" if timeout.negative?
        end
        interests = { readables => IO::READABLE, writables => IO::WRITABLE, exceptables => IO::PRIORITY }
        deadline = Clock.now + timeout if timeout
        loop do
          result = without_hooks { ::IO.select(readables, writables, exceptables, 0) }
          return result if result

          remaining = deadline && deadline - Clock.now
          return nil if remaining && remaining <= 0

          wait_for_any(interests, remaining)
        end
      end

      private

      # Linux's memory devices that never block (major 1; minor 3 /dev/null,
      # 5 /dev/zero, 7 /dev/full, 9 /dev/urandom): never waited on. Not
      # /dev/random (it could block before Linux 5.6) nor /dev/kmsg (EAGAIN
      # until the next message).
      MEMORY_DEVICES = RUBY_PLATFORM.include?("linux") ? [3, 5, 7, 9].freeze : [].freeze
      private_constant :MEMORY_DEVICES

      # Whether `io` (a File) is always readable and writable: a regular
      # file, or one of {MEMORY_DEVICES}. Ruby waits on them too (compiling
      # a file waits for it to be readable), and the selector could only say
      # so after a turn of the loop: epoll refuses them (EPERM), and select,
      # which reports them ready, was seen under GC.stress to time out again
      # and again with /dev/null among its descriptors (Ruby 3.4), holding
      # the fiber for a minute. A FIFO, a terminal or any other device
      # waits in the selector, and so does a wait for IO::PRIORITY (a
      # regular file under /proc or /sys reports a change that way).
      def always_ready?(io)
        stat = io.stat
        stat.file? || (stat.chardev? && stat.rdev_major == 1 && MEMORY_DEVICES.include?(stat.rdev_minor))
      rescue IOError, SystemCallError
        false
      end

      # The hot path of every IO wait: keep it lean.
      #
      # A fiber woken by Scheduler#wake_next runs first (#give_way), and only
      # then does the wait's timer start: one started before would run down
      # while the caller gave way, and fire before its wait began. io_wait's
      # timeout would resume it in #give_way, and its wait in the selector
      # would then have no timeout at all; IO#timeout would raise
      # IO::TimeoutError there, before it had looked at its IO.
      #
      # The timer: `timeout` seconds makes the wait return false (io_wait's
      # own timeout); else, for a wait with a `direction` ("ready",
      # "readable", "writable"; the hooks'), IO#timeout of `io` if it has
      # one raises IO::TimeoutError naming it. Other waits (a child process,
      # io_select's watchers, io_pread on io_uring) have none.
      def in_selector(fiber, io = :process, direction = nil, timeout = nil)
        give_way(fiber) if @runs_next
        if timeout
          deadline = @wait_deadlines.start(fiber, timeout)
        elsif direction
          timer = io_timeout_timer(io, fiber, direction)
        end
        begin
          @io_waiting += 1
          @waits[fiber] = io
          arm_close_watch unless @close_watch || !CLOSE_WATCH
          @running = nil
          yield
        ensure
          @io_waiting -= 1
          @waits.delete(fiber)
          @running = fiber
          @switches += 1
          deadline&.disarm
          @timers.cancel(timer) if timer
        end
      end

      # Before Ruby 4.0 (which calls #fiber_interrupt; 3.4.11 does not yet),
      # nothing tells a scheduler that an IO a fiber waits on was closed by
      # another fiber or thread, and epoll silently drops the closed
      # descriptor: the fiber would wait forever. While fibers wait on IO, the
      # loop looks every CLOSE_WATCH seconds for closed ones and raises
      # IOError in their fiber, as Ruby does for a thread.
      CLOSE_WATCH = RUBY_VERSION < "4.0" ? 0.1 : nil
      # How many waits a look may check per CLOSE_WATCH seconds: with more
      # fibers waiting, the looks come further apart (1 s at 10,000 waits),
      # so that a loop holding many idle waits (a server's keep-alive
      # connections) spends about 10,000 checks a second on the watch, not
      # 10 a second for each wait.
      CLOSE_WATCH_WAITS = 1000
      private_constant :CLOSE_WATCH, :CLOSE_WATCH_WAITS

      def arm_close_watch
        interval = CLOSE_WATCH * [@io_waiting.fdiv(CLOSE_WATCH_WAITS), 1].max
        @close_watch = @timers.after(interval) do
          @close_watch = nil
          interrupt_closed_waits
          arm_close_watch if @io_waiting.positive?
        end
      end

      # Raises IOError in every fiber waiting in the selector on an IO that
      # has been closed meanwhile.
      def interrupt_closed_waits
        closed = nil # most looks find none, and allocate nothing
        @waits.each { |fiber, waited| (closed ||= []) << [fiber, waited] if waited.is_a?(IO) && waited.closed? }
        closed&.each do |fiber, io|
          interrupt_fiber(fiber, IOError.new("stream closed in another thread")) { @waits[fiber].equal?(io) }
        end
      end

      if Fiber.respond_to?(:blocking)
        # Runs the block in a blocking state: IO in it calls no hook of ours.
        def without_hooks(&block)
          Fiber.blocking(&block)
        end
      else
        def without_hooks(&block)
          Fiber.new(blocking: true, &block).resume
        end
      end

      # Runs a positioned read (`yield done, chunk` -> bytes moved)
      # until `length` bytes (at least one attempt when 0) or end of file,
      # without calling back into this scheduler; waits on the descriptor when
      # it would block. Errors become negated errnos, as the hooks return them.
      def positioned_io(io, length, room, events)
        done = 0
        loop do
          moved = without_hooks { yield(done, room - done) }
          return done if moved.zero?
          if moved.negative? # IO::Buffer reports an errno this way
            raise IO::EAGAINWaitReadable if -moved == Errno::EAGAIN::Errno

            return done.positive? ? done : moved
          end

          done += moved
          return done if done >= length || done >= room
        rescue IO::WaitReadable, IO::WaitWritable
          io_wait(io, events)
        rescue EOFError
          return done
        rescue SystemCallError => e
          return done.positive? ? done : -e.errno
        end
      end

      if IO.method_defined?(:timeout)
        # IO#timeout (Ruby 3.2+), the default deadline for this IO's waits.
        def io_timeout(io)
          io.timeout
        end
      else
        def io_timeout(_io)
          nil
        end
      end

      def io_timeout_timer(io, fiber, direction)
        timeout = io_timeout(io) or return
        @timers.after(timeout) do
          error = IO::TimeoutError.new("IO#timeout (#{timeout} s) expired waiting for #{io.inspect} to be #{direction}")
          interrupt_fiber(fiber, error) { @waits[fiber].equal?(io) }
        end
      end

      # Suspends the current fiber until one of the IOs is ready for its
      # events, or `timeout` seconds pass (for io_select).
      def wait_for_any(interests, timeout)
        waiter = Fiber.current
        watchers = []
        interests.each do |ios, events|
          ios&.each { |io| watchers << start_watcher(io, events, waiter) }
        end
        timer = @timers.after(timeout, @wake_callback, waiter) if timeout
        suspend
      ensure
        @timers.cancel(timer)
        watchers.each { |watcher| queued { @selector.raise(watcher, Cancelled) } if @waits[watcher].is_a?(IO) }
      end

      # A raw fiber that waits in the selector until `io` is ready, then wakes
      # `waiter`. Any error (a closed IO) also wakes it: its poll reports it.
      # IO.select takes any object with #to_io (an OpenSSL::SSLSocket): the
      # watcher waits on the IO itself (the object alone woke it only at
      # the timeout).
      def start_watcher(io, events, waiter)
        io = io.to_io
        watcher = Fiber.new(blocking: false) do
          in_selector(Fiber.current, io) { @selector.io_wait(Fiber.current, io, events) }
          wake(waiter)
        rescue Cancelled
          nil
        rescue StandardError
          wake(waiter)
        ensure
          @running = nil
        end
        start(watcher)
        watcher
      end
    end
  end
end
