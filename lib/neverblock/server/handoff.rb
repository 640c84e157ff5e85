# frozen_string_literal: true

require "socket"
require "tmpdir"

module NeverBlock
  class Server
    # Keep-alive connections moved from a worker that serves more of them to
    # the sibling that serves the fewest, so that clients that keep their
    # connections (every request behind a proxy) share the workers evenly.
    #
    # Why: a connection stays with the worker that accepted it, and which
    # worker accepts is the kernel's and the moment's choice. Ten keep-alive
    # clients over two workers came out 9 to 1 in most runs: nine clients
    # shared one core while one had the other to itself, and their requests
    # waited four times their fair share. Closing the connection to make the
    # client reconnect elsewhere would cost a handshake (and a TLS one) and
    # race the client's next request; this moves the socket itself.
    #
    # How: the master makes one {Handoff} before it forks ({.build}): a
    # scoreboard in shared memory with one slot per worker index (the pid
    # serving it and how many connections it serves that are not parked
    # idle), and for each index a Unix datagram socket pair. A worker
    # ({#attach}, then {#open} in its loop) keeps its own slot current
    # ({#publish}). A connection parked in the worker's {IdleSet} (after a
    # request that held its slot Connection::TURN or longer, or after idling)
    # whose socket turns readable asks {#hand_off} before it is resumed, with
    # nothing of its next request read (Connection#hand_off): if a sibling
    # serves at least {MARGIN} fewer connections, the socket's descriptor
    # goes to that sibling's pair (SCM_RIGHTS) with the index of the
    # listener it came from, and the connection ends here without closing
    # the socket for the client. The sibling's receiving task ({#receive})
    # serves it as if it had accepted it; a request the client already sent
    # waits in the socket, unread. Moving one connection closes a gap of two,
    # so counts even out and then stay put: a balanced server moves nothing.
    #
    # What does not move: TLS connections (their session lives in this
    # process), hijacked sockets, connections with bytes of a next request
    # already read (pipelining), and connections of a stopping worker. A
    # connection whose requests take less than Connection::TURN does not
    # park between them and never asks (a fast app is not worth a syscall a
    # request); without an {IdleSet} (not Linux) none does. A worker looks
    # at the scoreboard at most every {INTERVAL}. A pair whose queue is full
    # (its sending end's buffer: a few hundred moves waiting) refuses, and
    # the connection stays.
    #
    # Connections in a pair's queue belong to the worker index, not the
    # process: a worker replaced for that index (a crash, a rolling restart)
    # takes them up; the master holds every pair, so the kernel keeps them
    # meanwhile. A worker that stops closes its slot ({#close}) as it begins to
    # drain, and serves what siblings sent before that until its drain ends
    # (Acceptor#take_last_handoffs). While the master replaces or stops
    # workers it pauses every move ({#paused=}). A connection sent in the
    # instant between a sibling reading a worker's slot and that worker
    # retiring for good (TTOU, a stop) waits in the index's pair until the
    # master exits.
    #
    # Off with `NEVERBLOCK_HANDOFF=off`, with fewer than two workers at the
    # start (a master that TTIN grows from one has none), where Ruby lacks
    # IO::Buffer.map or Unix sockets, and without an {IdleSet} (not Linux,
    # or `NEVERBLOCK_IDLE_SET=off`): no connection parks to wait its turn.
    #
    # Thread-safety: each process uses it from its loop (a worker) or its
    # main thread (the master). The scoreboard is read and written without
    # locks across processes: each slot is written by its own worker (and
    # nudged by senders, see #hand_off), and every value is a hint that the
    # next write corrects.
    class Handoff
      # The environment variable that turns it off (`off`).
      SWITCH = "NEVERBLOCK_HANDOFF"

      # A worker hands a connection on only to a sibling serving at least
      # this many fewer: one move closes a gap of two, so a smaller margin
      # would move connections back and forth.
      MARGIN = 2

      # Seconds between two looks at the scoreboard ({#hand_off}): a worker of
      # many short IO-bound requests (a thousand a second) would otherwise
      # read it at every one.
      INTERVAL = 0.001

      # The count a worker publishes while it has no room for another
      # connection (`max_connections`): no sibling picks it.
      FULL = 0xFFFF_FFFF

      # Bytes before the first slot: the master's pause flag (see #paused=).
      HEADER = 8
      private_constant :HEADER

      # Bytes of a slot: the pid serving the index (0: none), and its active
      # connections, each a 32-bit unsigned integer.
      SLOT = 8
      private_constant :SLOT

      # @return [Boolean] whether this Ruby and platform can: IO::Buffer.map
      #   (Ruby 3.1+) for the scoreboard and SCM_RIGHTS for the sockets.
      def self.available?
        defined?(IO::Buffer) && IO::Buffer.respond_to?(:map) && defined?(UNIXSocket) &&
          Socket.const_defined?(:SCM_RIGHTS) ? true : false
      end

      # Makes the master's Handoff for `workers` worker indexes, or nil when
      # it is off (see the class comment).
      # @param workers [Integer] the worker count the master starts with.
      # @return [Handoff, nil]
      def self.build(workers)
        return nil if workers < 2 || ENV[SWITCH] == "off" || !available?

        new(workers)
      rescue SystemCallError, IOError, ArgumentError => e
        NeverBlock.logger.warn("NeverBlock::Server: workers will not move keep-alive connections to each other " \
                               "(#{e.class}: #{e.message})")
        nil
      end

      # @param workers [Integer] pairs to make now; the scoreboard has room
      #   for four times as many indexes (more workers added with TTIN).
      def initialize(workers)
        @capacity = [workers * 4, 16].max
        @scoreboard = map_shared(HEADER + @capacity * SLOT)
        @pairs = Array.new(workers) { Socket.pair(:UNIX, :DGRAM, 0) } # [sending end, receiving end]
        @index = nil
        @receiver = nil
        @listeners = nil
        @active = nil
        @next_look = 0.0
        @open = false
      end

      # The master, before it forks a worker of `index`: makes that index's
      # pair if it has none (a worker added with TTIN). Workers forked
      # earlier do not have it and never send to it; beyond the
      # scoreboard's room an index gets none.
      # @param index [Integer]
      # @return [void]
      def prepare(index)
        @pairs[index] ||= Socket.pair(:UNIX, :DGRAM, 0) if index < @capacity
      end

      # The master, when a worker of `index` exited: its slot is closed
      # unless another process (its successor) holds it already.
      # @param index [Integer]
      # @param pid [Integer]
      # @return [void]
      def vacate(index, pid)
        return unless index < @capacity && @scoreboard.get_value(:u32, slot(index)) == pid

        @scoreboard.set_value(:u32, slot(index), 0)
      end

      # The master, as it supervises: while workers are being replaced or
      # stopped (a rolling restart, recycling, TTOU, a stop), no connection
      # moves. Rolling restarts under keep-alive load lost a request in one
      # run out of four or five with moves going on (none without), so a
      # deploy does not move connections.
      # @param value [Boolean]
      def paused=(value)
        flag = value ? 1 : 0
        @scoreboard.set_value(:u32, 0, flag) unless @scoreboard.get_value(:u32, 0) == flag
      end

      # In a worker, after the fork: it serves `index`, with `listeners` in
      # the order every worker has them, and `active` tells how many of its
      # connections are not parked idle.
      # @param index [Integer]
      # @param listeners [Array<Listener>]
      # @param active [#call] returns an Integer.
      # @return [Boolean] whether this worker takes part (its index has a pair).
      def attach(index, listeners, active)
        pair = @pairs[index] or return false

        @index = index
        @receiver = pair.last
        @listeners = listeners
        @listener_indexes = listeners.each_with_index.to_h.compare_by_identity
        @active = active
        true
      end

      # Opens this worker's slot: siblings may hand it connections.
      # @return [void]
      def open
        @scoreboard.set_value(:u32, slot(@index) + 4, @active.call)
        @scoreboard.set_value(:u32, slot(@index), Process.pid)
        @open = true
      end

      # Closes this worker's slot (it is stopping): siblings send it no more,
      # and it neither writes its slot (a successor may hold it already) nor
      # hands connections on.
      # @return [void]
      def close
        return unless @open

        @open = false
        vacate(@index, Process.pid)
      end

      # Writes this worker's count of active connections to its slot.
      # @return [void]
      def publish
        @scoreboard.set_value(:u32, slot(@index) + 4, @active.call) if @open
      end

      # Hands `io` (a plain socket at a request boundary, nothing of its next
      # request read) to the sibling serving the fewest connections, if it
      # serves at least {MARGIN} fewer than this worker.
      # @param io [Socket] the connection's socket; the caller closes its own
      #   descriptor afterwards when this returns true (the client's
      #   connection stays open: the sibling holds it).
      # @param listener [Listener] that accepted it.
      # @param now [Float] monotonic seconds: it looks at most every {INTERVAL}.
      # @return [Boolean] whether it was handed on.
      def hand_off(io, listener, now)
        return false if !@open || now < @next_look || @scoreboard.get_value(:u32, 0) == 1

        @next_look = now + INTERVAL
        own = @active.call
        @scoreboard.set_value(:u32, slot(@index) + 4, own)
        target = fewest(own - MARGIN) or return false
        listener_index = @listener_indexes[listener] or return false

        sent = @pairs[target].first.sendmsg_nonblock([listener_index].pack("n"), 0, nil,
                                                     Socket::AncillaryData.unix_rights(io), exception: false)
        return false if sent == :wait_writable

        # Until the sibling publishes, count the move on both sides, so that
        # the next requests here do not all pick the same sibling.
        @scoreboard.set_value(:u32, slot(target) + 4, @scoreboard.get_value(:u32, slot(target) + 4) + 1)
        @scoreboard.set_value(:u32, slot(@index) + 4, own - 1)
        true
      rescue SystemCallError, IOError
        false
      end

      # Whether a sibling serves at least {MARGIN} fewer connections than
      # this worker: its acceptor then leaves the backlog to the siblings a
      # moment (Acceptor#take_in_after_first takes no more than its share of
      # the backlog then), so that connections arriving together
      # are spread at once rather than moved one by one afterwards.
      # @return [Boolean]
      def sibling_less_busy?
        return false unless @open

        own = @active.call
        @scoreboard.set_value(:u32, slot(@index) + 4, own)
        !fewest(own - MARGIN).nil?
      end

      # A connection a sibling handed to this worker, if one waits.
      # @return [Array(Socket, Listener), nil]
      def receive
        message = @receiver.recvmsg_nonblock(2, 0, 64, scm_rights: true, exception: false)
        return nil if message == :wait_readable || message.nil?

        data, _address, _flags, *controls = message
        sockets = controls.flat_map { |control| control.unix_rights || [] }
        listener = @listeners[data.unpack1("n")] if data && data.bytesize == 2
        # Several descriptors in one message, or none (this process is out of
        # descriptors: the kernel dropped it), or no such listener.
        return reject(sockets) unless listener && sockets.size == 1

        [sockets.first, listener]
      end

      # Waits (in the loop) until a sibling may have handed this worker a
      # connection.
      # @return [void]
      def wait_readable
        @receiver.wait_readable
      end

      private

      # The sibling index with the fewest active connections, if at most
      # `most`, whose slot is open and whose pair this process has.
      def fewest(most)
        best = nil
        @pairs.each_index do |index|
          next if index == @index || @pairs[index].nil? || @scoreboard.get_value(:u32, slot(index)).zero?

          count = @scoreboard.get_value(:u32, slot(index) + 4)
          if count <= most
            best = index
            most = count
          end
        end
        best
      end

      # Where the slot of worker `index` begins in the scoreboard.
      def slot(index)
        HEADER + index * SLOT
      end

      def reject(sockets)
        NeverBlock.logger.warn("NeverBlock::Server: a connection handed over by a sibling worker was lost " \
                               "(#{sockets.size} descriptors arrived; out of file descriptors? ulimit -n)")
        sockets.each(&:close)
        nil
      end

      # Shared memory for the scoreboard: an unlinked temporary file mapped
      # shared, which every forked worker inherits.
      def map_shared(size)
        file = File.open(File.join(Dir.tmpdir, "neverblock-handoff-#{Process.pid}-#{object_id}"),
                         File::RDWR | File::CREAT | File::EXCL, 0o600)
        begin
          File.unlink(file.path)
          file.truncate(size)
          experimental = Warning[:experimental]
          Warning[:experimental] = false # IO::Buffer is experimental on Ruby 3.1-3.3
          IO::Buffer.map(file, size, 0)
        ensure
          Warning[:experimental] = experimental unless experimental.nil?
          file.close # the mapping stays
        end
      end
    end
  end
end
