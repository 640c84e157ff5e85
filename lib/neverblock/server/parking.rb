# frozen_string_literal: true

module NeverBlock
  class Server
    # A {Connection} between requests: waiting for the first bytes of its
    # next request (holding no request slot), parked in the server's
    # {IdleSet} (without a fiber, or in it while it waits its turn), resumed,
    # handed to a less busy sibling ({Handoff}), or ended by the
    # {IdleSweeper} (idle timeout) or a stop. Included in Connection; uses
    # its state (`@socket`, `@io`, `@context`, `@limits`, `@fiber`,
    # `@task`...). Called by the connection's own request loop
    # (#read_next_request, from #read_more), by the {Acceptor} (#unpark,
    # #hand_off, #wake_turn, #close_if_idle) and by the
    # {IdleSweeper} (#park_idle, #expire_idle, #settle).
    module Parking
      # @return [Boolean] true while it waits for its next request in the
      #   server's {IdleSet}, with no task: the task that parked it ended
      #   without closing it.
      def parked?
        @parked
      end

      # The {IdleSet} took it out (its socket is readable): a task is about
      # to {#resume} it, unless it is handed on ({#hand_off}).
      # @return [Boolean] whether it was parked waiting its turn (see {#park}):
      #   only such a connection may be handed on.
      def unpark
        @parked = false
        end_turn_park
      end

      # A connection parked to wait its turn that is still parked a sweep
      # interval later (the {IdleSweeper} says so) is idle: it no longer
      # counts as active for the {Handoff}, and gives up the fiber it waited
      # in, if it kept one (see #wait_turn).
      # @return [void]
      def settle
        end_turn_park
        wake_turn
      end

      # Wakes the fiber the connection waits its turn in (#wait_turn), if
      # it kept one, on the loop's next turn: unparked, it reads its next
      # request; still parked (settled), it gives the fiber up; closed
      # (handed to a sibling, idle timeout, stop: Connection#close), it ends.
      # The {Acceptor} calls it for a connection the {IdleSet} took out.
      # @return [Boolean] whether a fiber waited there (none then needs a task).
      def wake_turn
        fiber = @turn_fiber or return false

        Fiber.scheduler.wake(fiber)
        true
      end

      # Offers the connection, just out of the {IdleSet} where it waited its
      # turn (call it only when {#unpark} said so), with nothing of its next
      # request read, to a less busy sibling worker ({Handoff}). Only such a
      # connection: it parked straight after a request whose waits on the
      # socket all ended, so the selector holds no registration of it (epoll
      # keeps one while any process holds the socket: a socket moved while
      # registered here would go on reporting here, under a descriptor number
      # the next accept reuses, and the loop would spin). A connection the
      # {IdleSweeper} parked from a wait in its fiber may still be registered
      # (a cancelled wait leaves it until the socket's next event), so it
      # stays; so does one whose parser read empty lines of the next request
      # (a sibling would count them afresh). The socket leaves the IdleSet's
      # own set before it goes.
      # @return [Boolean] whether a sibling took it: the server then closes
      #   this process's descriptor, and the client's connection stays open.
      def hand_off
        return false unless movable? && @context.hand_off(@io, @listener)

        @context.idle_set.forget(@io.fileno)
        true
      end

      # @return [Boolean] true while it waits for the first bytes of its next
      #   request, holding no slot.
      def idle?
        @idle
      end

      # Ends the connection now if it is waiting for a next request (for
      # {Server#stop}); one in the middle of a request is left to finish.
      # One whose next request's first bytes came meanwhile, unread yet (as
      # the stop's grace ended), is served instead, with `connection:
      # close`: closed, the request would be reset unread. Bytes that begin
      # no request (an empty line) do not keep it.
      # @return [void]
      def close_if_idle
        if @parked
          request_waiting? ? @context.idle_set.wake(@io.fileno) : closed_while_parked
        elsif @idle && @fiber && !request_waiting? # (not a resuming task that has not started: it has bytes to read)
          @task&.cancel
        end
      end

      # @return [Float, nil] when its wait for a next request times out
      #   (monotonic seconds), while it waits on the socket for one.
      attr_reader :idle_deadline

      # @api private
      # Parks the connection if its fiber waits for a next request and it
      # may park (see #park?): the {IdleSweeper} calls it once the wait
      # lasted a sweep interval. Its task then ends, and the fiber goes back
      # to the pool.
      # @return [void]
      def park_idle
        return if @turn_fiber # woken from its turn's wait, about to read its request

        Fiber.scheduler.interrupt(@task, IdleSweeper::Park.new) if @idle && @fiber && @task && !@parked && park?
      end

      # @api private
      # Ends its wait for a next request if {#idle_deadline} is `now` or
      # earlier (the {IdleSweeper}); the connection then closes. Not when
      # the request's first bytes have come meanwhile, unread yet: the
      # client sent in time, and the server has not got to it (closing with
      # unread bytes resets the connection, and the client loses the
      # request). A parked one is resumed at once, ahead of the {IdleSet},
      # which reports a few hundred readable sockets a turn (10,000 streams
      # opened at once on a server with no core to spare had 7,229 such
      # connections reset, their requests a sweep interval late in the set's
      # queue); one waiting in its fiber gets another sweep interval, as
      # often as the bytes are still there when it comes (the fiber's wait
      # reads them: bytes that make no request, such as part of a TLS
      # record, are then gone, and its deadline stays). Both for at most
      # another `idle_timeout` in all, until a request comes: a client
      # that trickles bytes that make no request (a TLS record never
      # finished) cannot keep a connection open by them.
      # @param now [Float] monotonic seconds.
      # @return [void]
      def expire_idle(now)
        deadline = @idle_deadline
        return unless deadline && deadline <= now

        if bytes_waiting? && now < (@idle_grace_until ||= deadline + @limits.idle_timeout)
          return @context.idle_set.wake(@io.fileno) if @parked

          @idle_deadline = [now + @context.idle_sweeper.interval, @idle_grace_until].min
          return @context.idle_sweeper.watch(self)
        end

        if @parked
          closed_while_parked
        elsif @fiber && @task
          Fiber.scheduler.interrupt(@task, IdleSweeper::Expired.new)
        end
      end

      private

      # Waits (idle) for the first bytes of the next request, for at most
      # `idle_timeout` seconds, holding no request slot; empty lines before
      # it do not end the wait (Parser#took_empty_lines?). The wait has no
      # timer of its own: the server's {IdleSweeper} ends it at
      # {#idle_deadline}, and parks the connection ({#park_idle}) once it
      # has waited one sweep interval: a client that sends its next request
      # at once (a busy keep-alive connection) finds its fiber still
      # waiting, which costs less than a park and a new task. Beyond
      # {IdleSet::WAITING_FIBERS} such waits a brisk connection (its last
      # next request came soon, see #came_back_soon?) waits a few
      # milliseconds ({BriefWaits}) and then parks, and any other parks at
      # once, so that many connections going idle together (a burst) do not
      # hold as many fibers, whose stack pages Ruby keeps resident once
      # touched.
      # @return [String, nil] the bytes, nil on EOF or idle timeout, or
      #   when it parked ({#parked?}).
      def read_next_request
        held = @slot # (then #release_slot reads the clock, and the idle deadline below takes that reading)
        took_turn = release_slot

        @idle = true
        buffer = @context.read_buffer
        # Straight after a response, a client that sends one request at a
        # time has not sent its next one yet: a read would find nothing,
        # a system call per request. Its wait comes first. A pipelining
        # client's next request may be there (Connection's @read_ahead), and
        # a resumed connection's is.
        answered = @just_answered
        @just_answered = false
        data = if took_turn || (answered && !@read_ahead)
                 :wait_readable
               else
                 @socket.read_nonblock(Connection::READ_SIZE, buffer, exception: false)
               end
        data = :wait_readable if @parser.took_empty_lines?(data)
        # (No `return` in this method: under its rescue and ensure Ruby makes
        # each one a throw, caught and thrown again at the ensure, two a
        # request, each with an object.)
        if data == :wait_readable
          # A resumed connection that found no request (TLS: part of a record)
          # keeps the deadline it parked with.
          @idle_deadline ||= (held ? @slot_freed_at : Clock.now) + @limits.idle_timeout
          @context.idle_sweeper.watch(self)
          idle_set = @context.idle_set
          # Its turn is taken in the order requests arrive: parked, its socket
          # reports once it is readable (one-shot), behind those that turned
          # readable before it. A wait in the selector would not keep that
          # order: epoll reports a level-triggered socket in the order of its
          # previous report, so the connection answered last in a round, whose
          # next request had not come yet when the loop looked, then waited
          # most of two rounds (ten clients of 20 ms pages: p99 163 ms, 100 in
          # turn). It waits there in its fiber (#wait_turn), unless
          # IdleSet::WAITING_FIBERS fibers wait already.
          if idle_set && took_turn && park?
            if idle_set.crowded?
              data = park(turn: true)
            else
              idle_set.fiber_waits += 1
              counted = true
              data = wait_turn(buffer)
            end
          elsif idle_set && idle_set.crowded? && park?
            if @brisk
              (brief = idle_set.brief_waits).add(self)
              data = read_when_ready(buffer)
            else
              data = park
            end
          else
            if idle_set
              idle_set.fiber_waits += 1
              counted = true
            end
            data = read_when_ready(buffer)
          end
        elsif @answered
          @brisk = came_back_soon?
        end
        data
      rescue IdleSweeper::Expired
        nil
      rescue IdleSweeper::Park # at a TLS write in the first read of a resumed connection
        @wait_cut = true
        park? ? park : nil
      ensure
        idle_set.fiber_waits -= 1 if counted
        brief&.delete(self)
        unless @parked
          @idle = false
          @idle_deadline = nil
          @idle_grace_until = nil
        end
      end

      # Waits its turn (see #read_next_request) parked in the {IdleSet}, as
      # #park(turn: true) does, but in its own fiber: the set's report wakes
      # it (Acceptor#wake_parked, #wake_turn), in the order the requests
      # arrived, and no task ends or starts for the next request (a task
      # costs a hello request a fifth of its instructions). Settled by the
      # {IdleSweeper} (idle a sweep interval), it gives the fiber up and
      # stays parked, as #park leaves it; so does one whose task is
      # cancelled meanwhile. Closed meanwhile, it ends.
      # @return [String, nil] the bytes; nil when it gave its fiber up, or
      #   on EOF or a close.
      def wait_turn(buffer)
        park(turn: true)
        @fiber = @turn_fiber = Fiber.current
        begin
          Fiber.scheduler.suspend
        ensure
          @turn_fiber = nil
          @fiber = nil if @parked
        end
        return if @parked || @io.closed?

        data = @socket.read_nonblock(Connection::READ_SIZE, buffer, exception: false)
        data = :wait_readable if @parser.took_empty_lines?(data)
        return read_when_ready(buffer) if data == :wait_readable

        @brisk = came_back_soon? if data && @answered
        data
      end

      # #read_next_request's wait in its fiber, until bytes come (empty
      # lines go on waiting), or the {IdleSweeper} parks it.
      # @return [String, nil] the bytes; nil when it parked, or on EOF.
      def read_when_ready(buffer)
        while true # rubocop:disable Style/InfiniteLoop -- Kernel#loop adds a C frame to every idle fiber's stack
          begin
            @socket.wait_readable
            data = @socket.read_nonblock(Connection::READ_SIZE, buffer, exception: false) # (TLS may wait to write)
          rescue IdleSweeper::Park
            @wait_cut = true
            return park if park?

            next
          end
          next if data == :wait_readable || @parser.took_empty_lines?(data)

          @brisk = came_back_soon? if @answered
          return data
        end
      end

      # Whether a sibling worker could take the connection over ({Handoff}):
      # a plain socket (a TLS session cannot leave this process) that the
      # app did not take, and whose waits on the socket all ended with an
      # event: one cut short (the {IdleSweeper} parking it) leaves the
      # selector's level-triggered registration behind until the socket's
      # next event, which the connection may read before the selector looks
      # (see {#hand_off}), so such a connection never moves.
      def movable?
        !@listener.tls && !@hijacked && !@wait_cut && @parser.at_boundary?
      end

      # Whether the wait for the next request may end the connection's task
      # (see {IdleSet}): the server has an idle set and is not stopping
      # (a stopping server's idle waits are cancelled by its tasks), the app
      # did not take the socket, and TLS holds no decrypted bytes, which
      # the socket's readability would not announce. Nothing of the next
      # request is read: it waits at a message boundary with no pipelined
      # request left.
      def park?
        @context.idle_set && !@context.stopping? && !@hijacked && !(@listener.tls && @socket.ssl.pending.positive?)
      end

      # Whether the wait for the next request that just ended (with bytes)
      # was short: none at all, or shorter than a sweep interval (the time a
      # connection may wait in its fiber before it parks). Beyond
      # {IdleSet::WAITING_FIBERS} fiber waits only such a brisk connection
      # waits briefly ({BriefWaits}) for its next request; the others park
      # at once, so that connections that made one request and went idle (a
      # burst of new clients) return their fibers to the pool at once and
      # the next ones reuse them, rather than making new fibers, whose
      # stacks Ruby keeps until a GC frees them (10,000 such connections
      # took 18.7 KB each instead of 4).
      def came_back_soon?
        deadline = @idle_deadline or return true

        Clock.now - deadline + @limits.idle_timeout < @context.idle_sweeper.interval
      end

      # Parks the connection in the server's {IdleSet}: its task ends, and
      # {#resume} goes on in another once the socket is readable. `turn`:
      # it waits its turn for a next request on its way, not idle
      # ({Context#turns_parked} counts it among the active connections).
      def park(turn: false)
        @context.idle_set.park(self, @io.fileno)
        if turn
          @turn = true
          @context.turns_parked += 1
        end
        @parked = true
        @brisk = false
        @fiber = nil
        nil
      end

      # Whether the first bytes of a next request wait in the socket: a
      # method's first letter (on a TLS connection, any record: a request's
      # cannot be told from others'). An empty line between requests is not.
      def request_waiting?
        byte = first_byte_waiting or return false
        @listener.tls || byte.between?(65, 90)
      end

      # Whether the client's next bytes wait in the socket.
      def bytes_waiting?
        !first_byte_waiting.nil?
      end

      # @return [Integer, nil] the first byte the client sent that is not
      #   read yet (Connection#peek); nil when none came, at end of file, or
      #   when the socket fails.
      def first_byte_waiting
        peeked = peek
        peeked.getbyte(0) if peeked.is_a?(String)
      rescue IOError, SystemCallError
        nil
      end

      # Closes a parked connection (idle timeout, stop): out of the set, then
      # what the end of its task would have done.
      def closed_while_parked
        @context.idle_set.unpark(@io.fileno)
        @parked = false
        end_turn_park
        @idle = false
        @idle_deadline = nil
        @context.connection_closed(self)
      end

      # @return [Boolean] whether it was parked waiting its turn.
      def end_turn_park
        return false unless @turn

        @turn = false
        @context.turns_parked -= 1
        true
      end
    end
  end
end
