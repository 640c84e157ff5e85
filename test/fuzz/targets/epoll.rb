# frozen_string_literal: true

require "neverblock/epoll"

module NeverBlockFuzz
  module Targets
    # NeverBlock::Epoll (ext/neverblock/epoll), the server's set of parked
    # connections: random sequences of calls on one set and a few pipes,
    # checked against a model of what the kernel must answer. Pipes are
    # opened, written, drained and closed (either end); their read ends
    # armed, deleted and re-armed; #ready taken; the set closed, or dropped
    # without a close for the GC to close; and the calls given descriptors
    # that are negative, open nowhere (1,000,000), out of int range, not
    # Integers, the set's own or a regular file's, and made on a closed set.
    #
    # Oracles, beside the sanitizers: #arm says whether it added; #ready
    # reports exactly the armed read ends that are readable (data, or the
    # write end closed), each once until armed again, at most READY_MAX per
    # call; the set's descriptor polls readable exactly when #ready has
    # something; misuse raises SystemCallError, IOError, RangeError or
    # TypeError; and after each case the process has the descriptors it had
    # before (a set dropped unclosed is closed by the GC).
    class Epoll < Target
      READY_MAX = 256 # epoll.c's

      # Dropped sets are left for a GC after one case in GC_EVERY (a GC
      # takes several milliseconds under ASan, longer than a case), or once
      # DROPPED_MAX are waiting (each holds a descriptor).
      GC_EVERY = 20
      DROPPED_MAX = 100

      # @param mutator [Mutator] unused: the inputs here are calls.
      def initialize(mutator)
        super
        @file = File.open(__FILE__) # a descriptor epoll refuses (EPERM)
        @dropped = 0 # sets dropped unclosed since the last GC
      end

      # One case: up to 80 calls, or (one case in 300) a flood of ready pipes.
      # @param random [Random]
      # @param recorder [Recorder] told the case's seed only (its calls are
      #   made from the Random, so `bin/fuzz --case` replays them).
      def call(random, recorder)
        recorder.record("".b, calls: "made from the case's seed")
        @fds ||= open_fds # the process's own, before any case
        @epoll = NeverBlock::Epoll.new
        @pipes = [] # [reader, writer]
        @in_set = {}  # read end's descriptor => armed?
        @readable = {} # read end's descriptor => true once written or its writer closed
        random.rand(300).zero? ? flood(random) : random.rand(1..80).times { step(random) }
      ensure
        finish(random)
      end

      # Descriptors and memory that opening, using and closing sets over
      # and over must not leak (see Worker#leak_check).
      def repeat(_inputs, times)
        times.times do |i|
          epoll = NeverBlock::Epoll.new
          reader, writer = IO.pipe
          epoll.arm(reader.fileno)
          writer.write("x")
          epoll.ready
          epoll.arm(reader.fileno)
          epoll.delete(reader.fileno)
          epoll.close unless (i % 4).zero? # the rest closed by the GC
          reader.close
          writer.close
        end
      end

      private

      def step(random)
        case random.rand(16)
        when 0, 1 then open_pipe
        when 2, 3 then arm(random)
        when 4, 5 then write(random)
        when 6 then drain(random)
        when 7 then close_end(random, 1)
        when 8 then close_end(random, 0)
        when 9, 10 then ready
        when 11 then delete(random)
        when 12 then misuse(random)
        when 13 then poll
        when 14 then @epoll.close if random.rand(8).zero?
        else replace_set
        end
      end

      def open_pipe
        return if @pipes.size >= 24

        @pipes << IO.pipe
      end

      def pipe(random)
        @pipes[random.rand(@pipes.size)] unless @pipes.empty?
      end

      def arm(random)
        reader, = pipe(random)
        return unless reader

        fd = reader.fileno
        added = expect_open { @epoll.arm(fd) }
        return if added.nil?
        raise Failure, "arm(#{fd}) returned #{added.inspect}, its descriptor #{@in_set.key?(fd) ? 'being' : 'not'} in the set" unless added == !@in_set.key?(fd)

        @in_set[fd] = true
        @counts[:armed] += 1
      end

      def write(random)
        reader, writer = pipe(random)
        return if reader.nil? || writer.closed?

        writer.write_nonblock("x", exception: false)
        @readable[reader.fileno] = true
      end

      def drain(random)
        reader, writer = pipe(random)
        return unless reader

        loop { break unless reader.read_nonblock(4096, exception: false).is_a?(String) }
        @readable.delete(reader.fileno) unless writer.closed?
      end

      # Closes a pipe's write end (side 1: its reader reports the hang-up),
      # or its read end (side 0: the kernel takes it out of the set).
      def close_end(random, side)
        chosen = pipe(random) or return
        reader, writer = chosen
        if side == 1
          return if writer.closed?

          writer.close
          @readable[reader.fileno] = true
        else
          fd = reader.fileno
          reader.close
          writer.close unless writer.closed?
          @pipes.delete(chosen)
          @in_set.delete(fd)
          @readable.delete(fd)
        end
      end

      def ready
        got = expect_open { @epoll.ready } or return
        expected = @in_set.select { |fd, armed| armed && @readable[fd] }.keys.sort
        unless got.uniq.size == got.size && (got - expected).empty? &&
               got.size == [expected.size, READY_MAX].min
          raise Failure, "ready returned #{got.sort.inspect}; the armed readable descriptors were #{expected.inspect}"
        end

        got.each { |fd| @in_set[fd] = false } # one-shot: disarmed, still in the set
        @counts[:reported] += got.size
      end

      def delete(random)
        reader, = pipe(random)
        return unless reader

        fd = reader.fileno
        deleted = expect_open { @epoll.delete(fd) }
        return if deleted.nil?
        raise Failure, "delete(#{fd}) returned #{deleted.inspect}, its descriptor #{@in_set.key?(fd) ? 'being' : 'not'} in the set" unless deleted == @in_set.key?(fd)

        @in_set.delete(fd)
      end

      # The set's descriptor is readable exactly when #ready has something.
      def poll
        fd = expect_open { @epoll.fileno } or return
        io = IO.for_fd(fd, autoclose: false)
        readable = !IO.select([io], nil, nil, 0).nil?
        expected = @in_set.any? { |descriptor, armed| armed && @readable[descriptor] }
        raise Failure, "the set's descriptor polls #{readable ? '' : 'not '}readable, #ready having #{expected ? 'some' : 'none'}" unless readable == expected
      ensure
        io&.close
      end

      # Calls with descriptors no connection has: each must raise a Ruby
      # exception, or (delete of one not in the set) return false.
      def misuse(random)
        bad = [-1, -(1 << 31), 1 << 31, 1 << 40, 1 << 70, 1e12, 1_000_000, "3", nil, :fd, @file.fileno,
               (@epoll.closed? ? -1 : @epoll.fileno)]
        fd = bad[random.rand(bad.size)]
        method = random.rand(2).zero? ? :arm : :delete
        begin
          result = Sanitizer.raising_through_c { @epoll.public_send(method, fd) }
        rescue SystemCallError, IOError, RangeError, TypeError
          @counts[:misuse_raised] += 1
          return
        end
        raise Failure, "#{method}(#{fd.inspect}) returned #{result.inspect}" unless method == :delete && result == false && fd.is_a?(Integer)

        @counts[:misuse_returned] += 1
      end

      # Drops the set without closing it and starts over with a new one: the
      # old one's descriptor is the GC's to close (see #finish). Its pipes
      # stay open, out of any set.
      def replace_set
        @epoll = NeverBlock::Epoll.new
        @in_set.clear
        @dropped += 1
        @counts[:sets_dropped] += 1
      end

      def collect
        GC.start
        @dropped = 0
      end

      # A call on the set: nil (after checking the IOError) when it is closed.
      def expect_open
        result = yield
        raise Failure, "a closed set answered #{result.inspect}" if @epoll.closed?

        result
      rescue IOError => e
        raise Failure, "IOError on an open set: #{e.message}" unless @epoll.closed?

        @counts[:closed_set_calls] += 1
        nil
      end

      # More armed readable pipes than one #ready returns.
      def flood(random)
        (READY_MAX + random.rand(1..60)).times { @pipes << IO.pipe }
        @pipes.each do |reader, writer|
          @epoll.arm(reader.fileno)
          @in_set[reader.fileno] = true
          writer.write("x")
          @readable[reader.fileno] = true
        end
        3.times { ready } # READY_MAX, the rest, none
        raise Failure, "#{@in_set.count { |_, armed| armed }} still armed after a flood" if @in_set.value?(true)

        @counts[:floods] += 1
      end

      # Closes everything and checks that the process has the descriptors
      # it had before the first case: at once when no set was dropped
      # unclosed, else (to spare GCs) after one case in GC_EVERY, when a GC
      # has freed those sets and so closed them.
      def finish(random)
        @pipes&.each { |pair| pair.each { |io| io.close unless io.closed? } }
        @epoll&.close
        @epoll = nil
        return unless @dropped.zero? || @dropped > DROPPED_MAX || random.rand(GC_EVERY).zero?

        collect unless @dropped.zero?
        return if open_fds <= @fds

        collect # a set a stale reference on the machine stack kept alive: one more GC
        raise Failure, "#{open_fds - @fds} descriptors more than before the first case" if open_fds > @fds
      end

      def open_fds
        Dir.children("/proc/self/fd").size
      end
    end
  end
end
