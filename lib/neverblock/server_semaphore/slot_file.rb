# frozen_string_literal: true

require "fcntl"
require "set"
require_relative "../fork_hook"

module NeverBlock
  class ServerSemaphore
    # The permits of one named semaphore as this process sees them: a file
    # whose byte `i` stands for permit `i`, taken with a POSIX record lock
    # (fcntl F_SETLK, a write lock on that one byte). The kernel keeps the
    # count, so every process that opens the file shares it, and it releases
    # a process's locks when the process ends, however it ends (kill -9
    # included). Record locks are not inherited across fork: a worker forked
    # from a master or a mold that holds permits holds none.
    #
    # Who calls it: {ServerSemaphore} only. One SlotFile per file per
    # process ({.for}): record locks belong to the process, not to a file
    # descriptor, so a second descriptor would see this process's permits as
    # free, and closing it would drop them all. The one descriptor is open
    # only while this process holds or waits for a permit (or looks at the
    # holders), and closed once it holds none and none wait: an idle
    # semaphore holds no descriptor, and closing one that holds no lock
    # drops nothing.
    #
    # In the process, waiters queue on @turn (first come, first served);
    # only the one holding @turn looks for a free permit, and it looks again
    # when a permit of this process is given back (at once) or after a
    # backoff (permits of other processes: no signal crosses processes).
    #
    # Lock discipline: @turn is taken before @mutex, never the other way;
    # @mutex guards @held and is held around every lock and unlock so that
    # @held and the kernel's locks agree.
    class SlotFile
      # Seconds between looks for a permit another process gives back: the
      # first after RETRY_MIN, then twice as long each time, up to RETRY_MAX.
      RETRY_MIN = 0.001
      RETRY_MAX = 0.02

      # struct flock, as the platform lays it out (64-bit). The suite runs
      # on Linux; the macOS layout is from its headers, untested.
      FLOCK_LAYOUT =
        case RUBY_PLATFORM
        when /x86_64-linux|aarch64-linux/ then "s!s!x4q!q!i!x4" # l_type, l_whence, l_start, l_len, l_pid
        when /darwin/ then "q!q!i!s!s!" # l_start, l_len, l_pid, l_type, l_whence
        end
      private_constant :FLOCK_LAYOUT

      @files = {}
      @lock = Thread::Mutex.new

      class << self
        # @param path [String]
        # @return [SlotFile] this process's SlotFile of `path`, opened once.
        def for(path)
          @lock.synchronize { @files[path] ||= new(path) }
        end

        # In a forked child (one thread; the parent's other threads may have
        # held the lock when they vanished).
        # @return [void]
        def after_fork
          @lock = Thread::Mutex.new
          @files.each_value(&:after_fork)
        end
      end

      NeverBlock.on_fork_child { SlotFile.after_fork }

      # @return [String]
      attr_reader :path

      def initialize(path)
        unless FLOCK_LAYOUT
          raise NotImplementedError, "NeverBlock::ServerSemaphore runs on 64-bit Linux and macOS, not on #{RUBY_PLATFORM}"
        end

        @path = path
        @file = nil
        after_fork
      end

      # Resets what this process knows: a forked child holds no permit, and
      # the parent's waiters are not its own. The descriptor inherited from
      # the parent is closed: it carries none of the parent's locks (they
      # belong to the parent process), so that drops nothing.
      # @return [void]
      def after_fork
        @file&.close
        @file = nil
        @turn = Thread::Mutex.new
        @mutex = Thread::Mutex.new
        @given_back = Thread::ConditionVariable.new
        @held = Set.new
        @waiting = 0
      end

      # Waits for one of permits 0...limit, first come first served among
      # this process's callers. Cancelled or timed out while waiting, the
      # caller holds nothing (a permit is locked and recorded together, with
      # interrupts deferred).
      # @param limit [Integer]
      # @return [Integer] the permit's number, for {#give_back}.
      def take(limit)
        @mutex.synchronize do
          @waiting += 1
          open_file
        end
        begin
          @turn.synchronize { look_until_taken(limit) }
        ensure
          @mutex.synchronize do
            @waiting -= 1
            close_file_if_idle
          end
        end
      end

      # Gives back a permit {#take} returned, and wakes this process's next
      # waiter.
      # @param slot [Integer]
      # @return [void]
      def give_back(slot)
        @mutex.synchronize do
          lock(Fcntl::F_UNLCK, slot) if @held.delete?(slot)
          @given_back.signal
          close_file_if_idle
        end
      end

      # @param limit [Integer]
      # @return [Array<Integer, nil>] for each permit 0...limit, the pid of
      #   the process that holds it, nil when free.
      def holders(limit)
        @mutex.synchronize do
          open_file
          Array.new(limit) do |slot|
            next Process.pid if @held.include?(slot)

            request = flock(Fcntl::F_WRLCK, slot)
            @file.fcntl(Fcntl::F_GETLK, request)
            type, pid = unpack_flock(request)
            pid unless type == Fcntl::F_UNLCK
          end
        ensure
          close_file_if_idle
        end
      end

      # @return [Integer] callers of this process waiting for a permit.
      def waiting
        @waiting
      end

      private

      # Holding @mutex.
      def open_file
        @file ||= File.open(@path, File::RDWR | File::CREAT, 0o600)
      end

      # Holding @mutex: no lock of this process is on the file when none is
      # held, so closing it drops nothing.
      def close_file_if_idle
        return unless @file && @held.empty? && @waiting.zero?

        @file.close
        @file = nil
      end

      # Holding @turn: looks for a free permit until one is taken.
      def look_until_taken(limit)
        retry_after = RETRY_MIN
        @mutex.synchronize do
          loop do
            slot = try_take(limit) and return slot

            begin
              @given_back.wait(@mutex, retry_after)
            ensure
              # Ruby 3.1's Mutex#sleep under a fiber scheduler does not lock
              # the mutex again when the wait raises (cancelled, timed out).
              @mutex.lock unless @mutex.owned?
            end
            retry_after = [retry_after * 2, RETRY_MAX].min
          end
        end
      end

      # Holding @mutex: locks the first free permit, if any.
      # @return [Integer, nil]
      def try_take(limit)
        limit.times do |slot|
          next if @held.include?(slot)

          taken = Thread.handle_interrupt(Object => :never) do
            lock(Fcntl::F_WRLCK, slot) && @held.add(slot)
          end
          return slot if taken
        end
        nil
      end

      # @return [Boolean] false when another process holds the byte.
      def lock(type, slot)
        @file.fcntl(Fcntl::F_SETLK, flock(type, slot))
        true
      rescue Errno::EAGAIN, Errno::EACCES
        false
      end

      def flock(type, slot)
        if FLOCK_LAYOUT.start_with?("s")
          [type, IO::SEEK_SET, slot, 1, 0].pack(FLOCK_LAYOUT)
        else
          [slot, 1, 0, type, IO::SEEK_SET].pack(FLOCK_LAYOUT)
        end
      end

      # @return [Array(Integer, Integer)] l_type and l_pid.
      def unpack_flock(request)
        fields = request.unpack(FLOCK_LAYOUT)
        FLOCK_LAYOUT.start_with?("s") ? [fields[0], fields[4]] : [fields[3], fields[2]]
      end
    end
  end
end
