# frozen_string_literal: true

module NeverBlock
  class Server
    # Takes connections in and keeps the register of those open: one accept
    # task per listener, flow control (room for a connection, a free request
    # slot, a turn among the requests waiting for one), a pooled task per
    # connection, and the {Handoff} receiver of a worker beside others.
    #
    # Who calls it: {Server#serve_here} starts it ({#start}) and stops it
    # ({#stop_accepting}, {#drain}, {#close}); during a request only the
    # objects that report to it: {Admission} (`on_release`: {#room_freed},
    # {#pending_connections}), {Context} ({#hijacked} and {#close_connection}, for a
    # connection whose socket the app took or that closed while parked) and
    # the {IdleSet} ({#wake_parked}, a parked connection's socket became
    # readable). Nothing here calls back into the {Server}.
    class Acceptor
      # What a connection queued at a stop gets when there is no room to serve it.
      STOPPING_RESPONSE = "HTTP/1.1 503 Service Unavailable\r\nretry-after: 1\r\nconnection: close\r\n" \
                          "content-length: 0\r\n\r\n"
      private_constant :STOPPING_RESPONSE

      # Connections whose fibers start on one turn of the loop, at most: a
      # backlog of a thousand (a herd of event streams reconnecting at once)
      # is taken in BATCH a turn, so that each turn also runs the streams
      # already open (their next events) instead of leaving them waiting
      # while a thousand fibers start (0.3 s on one core, measured); fewer
      # while turns are long ({StartPace}).
      BATCH = StartPace::BATCH
      private_constant :BATCH

      # @return [Hash{Connection => true}] the open connections (not those
      #   the app took with rack.hijack).
      attr_reader :connections

      # @return [FiberPool, nil] the connections' fibers, while serving.
      attr_reader :pool

      # @param admission [Admission] the request slots; this acceptor
      #   becomes its `on_release`.
      # @param limits [Limits]
      # @param listeners [Array<Listener>]
      # @param workers [Integer] the server's worker count (0 or 1: this is
      #   the listeners' only worker).
      # @param app_tasks [AppTasks] the scope every connection's task is
      #   put in, and so what the app starts from its requests.
      def initialize(admission, limits, listeners, workers, app_tasks)
        @admission = admission
        admission.on_release = self
        @limits = limits
        @listeners = listeners
        @workers = workers
        @app_tasks = app_tasks
        @context = nil
        @connections = {}.compare_by_identity
        @pool = nil
        @scheduler = nil
        @tasks = [] # one accept task per listener
        @accepting = {} # listeners whose task waits for room or a connection (safe to cancel)
        @receiver = nil # the Handoff receiver's task
        @handoff = nil
        @idle_tasks = [] # the IdleSet's
        @waiters = [] # acceptors waiting for room
        @turn_waiters = 0 # acceptors waiting for a turn for a slot (#wait_turn)
        @starting = 0 # connections accepted whose fibers have not started yet
        @accept_failed_at = nil
        @paces = {}.compare_by_identity # listener => its StartPace, from backlog to backlog
      end

      # @return [Context] what every connection gets (set before {#start}).
      attr_accessor :context

      # Starts taking connections in, inside the running loop: the
      # connections' fiber pool, the {IdleSet} where idle keep-alive
      # connections park (where the platform has it), an accept task per
      # listener and, with a `handoff` this worker joined ({Handoff#attach}),
      # its receiver.
      # @param handoff [Handoff, nil]
      # @return [void]
      def start(handoff = nil)
        @scheduler = NeverBlock.current_scheduler!
        @pool = FiberPool.new(size: @limits.max_connections, queue_limit: 0) # keeps FiberPool::IDLE_LIMIT fibers after a burst
        start_idle_set
        @tasks = @listeners.map { |listener| NeverBlock.spawn(detached: true, internal: true) { accept_loop(listener) } }
        return unless handoff

        @handoff = handoff
        @context.handoff = handoff
        handoff.open
        @receiver = NeverBlock.spawn(detached: true, internal: true) { receive_handoffs }
      end

      # Stops the accept tasks (those waiting for room or a connection are
      # cancelled; one holding an accepted socket finishes serving it first)
      # and waits for them. The listeners stay open.
      # @return [void]
      def stop_accepting
        @listeners.zip(@tasks) { |listener, task| task.cancel if @accepting[listener] }
        @tasks.each(&:wait)
      end

      # At a stop, after {#stop_accepting} and before the listeners close:
      # what the kernel had already queued is taken in and answered (with
      # `connection: close`, as the stop does), as far as there is room; a
      # connection past that is told 503 and closed. Left queued, each would
      # be reset once every process closed its copy of the listening socket,
      # after which the kernel refuses new connections at once (the master
      # closes its copies on TERM).
      # @return [Integer] connections taken in or refused.
      def take_backlog
        @listeners.sum do |listener|
          taken = 0
          while taken < Listener::BACKLOG && (socket = listener.accept_now)
            taken += 1
            room_for_connection? ? open_connection(socket, listener) : refuse_at_stop(socket, listener)
          end
          taken
        end
      end

      # The end of a stop, after {#stop_accepting}: idle keep-alive
      # connections get up to `grace` seconds for a request already on its
      # way, what siblings handed over is served, the rest of the idle ones
      # close, and requests in flight get `shutdown_timeout` seconds before
      # they are cancelled.
      # @param grace [Numeric] seconds.
      # @return [void]
      def drain(grace)
        deadline = Clock.now + grace
        NeverBlock.sleep(0.02) while @connections.each_key.any?(&:idle?) && Clock.now < deadline
        take_last_handoffs
        @connections.keys.each(&:close_if_idle) # a copy: a parked one leaves @connections at once
        @pool.shutdown(@limits.shutdown_timeout)
      end

      # After {#drain} no task serves a connection: any still counted (a
      # resuming task cancelled before it started, one parked) is closed,
      # and so is the {IdleSet}.
      # @return [void]
      def close
        idle_set = @context.idle_set or return

        @idle_tasks.each(&:cancel)
        @connections.keys.each { |connection| close_connection(connection) }
        idle_set.close
        @context.idle_set = nil
      end

      # A request slot (from {Admission#release}) or a connection was given
      # back: acceptors waiting for room look again.
      # @return [void]
      def room_freed
        @waiters.each { |fiber| @scheduler.wake(fiber) } unless @waiters.empty?
      end

      # Connections the acceptors leave in the kernel's accept queues while
      # they wait for room: demand the adaptive limit counts like requests
      # waiting for a slot ({Admission}). A listener whose queue cannot be read
      # (a unix socket) counts as one while its acceptor waits.
      # @return [Integer]
      def pending_connections
        return 0 if @waiters.empty? && @turn_waiters.zero?

        @listeners.sum { |listener| listener.pending_connections || 1 }
      end

      # The app took the connection's socket (rack.hijack, see
      # Context#hijacked): it is no longer the server's to count, and the
      # server will not close it.
      # @return [void]
      def hijacked(connection)
        @connections.delete(connection)
        @context.idle_sweeper.forget(connection)
        room_freed
      end

      # A connection ended (its task's end, or closed while parked): its
      # socket is closed unless the app took it, and there is room for another.
      # @return [void]
      def close_connection(connection)
        @connections.delete(connection)
        @context.idle_sweeper.forget(connection)
        connection.close
        @context.handoff&.publish
        room_freed
      end

      # The IdleSet found a parked connection's socket readable: a pooled
      # task reads and serves it (or parks it again). The pool has room: it
      # has a fiber for each of `max_connections` connections, and a parked
      # one holds none. The task starts on the loop's next turn, with the
      # others the IdleSet found readable at once (see #accept_loop: one at a
      # time, they would get one a turn). Unless a less busy sibling takes it
      # over first (Connection#hand_off): then it ends here, its socket open
      # in the sibling.
      # @return [void]
      def wake_parked(connection)
        return close_connection(connection) if connection.unpark && connection.hand_off
        return if connection.wake_turn # it waited its turn in its fiber

        spawn_for(connection) { connection.resume }
      rescue StandardError => e
        NeverBlock.logger.error("NeverBlock::Server: could not resume an idle connection: #{e.class}: #{e.message}")
        close_connection(connection) # (again, if spawn_for did: finishing is idempotent)
      end

      # Open connections less those parked idle in the {IdleSet} (a connection
      # parked to wait its turn is active); {Handoff::FULL} while there is no
      # room for another connection, so that no sibling picks this worker.
      # What this worker publishes to a {Handoff} (see {Handoff#attach}).
      # @return [Integer]
      def active_connections
        return Handoff::FULL unless room_for_connection?

        idle_set = @context.idle_set
        idle_set ? @connections.size - idle_set.size + @context.turns_parked : @connections.size
      end

      private

      # Builds the {IdleSet} and starts its two tasks, or says (at debug
      # level) why idle connections each keep a fiber: not when switched
      # off, as the operator chose that, and a log that should stay empty
      # would get a line from every worker.
      def start_idle_set
        if (idle_set = IdleSet.build(method(:wake_parked)))
          @context.idle_set = idle_set
          @idle_tasks = [idle_set.method(:run), idle_set.brief_waits.method(:run)].map do |job|
            NeverBlock.spawn(detached: true, internal: true, &job)
          end
        elsif ENV[IdleSet::SWITCH] != "off" && (reason = IdleSet.missing_reason)
          NeverBlock.logger.debug("NeverBlock::Server") { "idle keep-alive connections each keep a fiber: #{reason}" }
        end
      end

      # Accepts while there is room: fewer than `max_connections` open (and
      # a free fiber for one) and a free request slot. A connection's fiber
      # starts on the loop's next turn (FiberPool#spawn(defer: true)), so the
      # acceptor starts up to BATCH of the backlog a turn (#pace) instead
      # of one connection a turn (15 a second when each turn runs 64
      # one-millisecond requests, while the rest waited in the backlog for
      # seconds). The only worker of the listener takes in all it has room
      # for (#start_held); beside other workers, its
      # free slots or its share of the backlog, once the first has run
      # (#take_in_after_first). When the slots are all taken it waits for a
      # turn among the requests waiting for one (#wait_turn) and then takes
      # in one connection, or, as the only worker, every connection waiting
      # by then: their requests queue behind those already waiting. With no
      # room for a connection it waits until one ends. None is
      # dropped. Only its waits (for room, for a connection) may be
      # interrupted by {#stop_accepting}: the turns it lets pass while it
      # holds accepted sockets (#start_held) are not.
      def accept_loop(listener)
        taken = 0 # connections taken in since the loop's last turn
        until @context.stopping?
          @accepting[listener] = true
          begin
            turn = wait_for_room
            socket = accept_now(listener)
            unless socket
              taken = 0
              listener.wait_readable
            end
          ensure
            @accepting.delete(listener)
          end
          next unless socket

          open_connection(socket, listener)
          taken = pace(taken + 1, listener)
          if alone?
            while turn && !@context.stopping? && room_for_connection? && (socket = accept_now(listener))
              open_connection(socket, listener)
              taken = pace(taken + 1, listener)
            end
          elsif !turn # after a turn its slots are all taken and the one it took waits for a slot already
            take_in_after_first(listener)
            taken = 0
          end
        end
      end

      # Counts a connection taken in; after BATCH of them, lets the loop
      # take a turn (their fibers start, timers fire, IO is read) before
      # more start: as the listener's only worker, it takes the rest of the
      # backlog in meanwhile (#start_held). @return [Integer] the count
      # since the last turn.
      def pace(taken, listener)
        return taken if taken < BATCH

        alone? ? start_held(listener) : @scheduler.yield
        0
      end

      # The listener's only worker, having started BATCH connections on this
      # turn: takes in the rest of the backlog at once, as far as there is
      # room (left in a full accept queue, a herd of 10,000 had 30,000 SYNs
      # dropped, each client waiting a second or more to send it again), and
      # starts what it holds BATCH a turn, or fewer after a long turn, or one
      # while the loop is saturated and late, or none (napping) while it is
      # far behind on its descriptors ({StartPace}), and those held 5 s
      # whatever the pace, taking in what arrived meanwhile each time. At a stop
      # it starts all it holds (each is answered with `connection: close`);
      # if it is cancelled, it closes them.
      def start_held(listener)
        held = []
        since = [] # when each was taken in
        HerdGC.herd_starting(@scheduler)
        # The listener's pace, from backlog to backlog: the next one's first
        # turns follow what the loop did on the last ones (within FRESH).
        pace = (@paces[listener] ||= StartPace.new(streams: @context.method(:streams_open)))
        loop do
          now = Clock.now
          while !@context.stopping? && room_for_connection?(held.size) && (socket = accept_now(listener))
            held << socket
            since << now
          end
          return if held.empty?

          count = @context.stopping? ? held.size : [pace.turn(@scheduler), pace.overdue(since)].max
          since.shift(count)
          held.shift(count).each { |socket| open_connection(socket, listener) }
        end
      rescue Exception # rubocop:disable Lint/RescueException -- a cancel: the sockets held are closed, not leaked
        held.each(&:close)
        raise
      ensure
        HerdGC.herd_started(@scheduler)
      end

      # Beside other workers, having just taken in one connection: lets that
      # connection run to its first wait (its first request answered, if it
      # came with it) before taking in more, then takes in as many as it has
      # free slots for (#room?, counting those not started yet), and at least
      # its share of the backlog (the connections waiting over the workers,
      # rounded up), whose fibers start together on the next turn. A worker
      # that dies on a request (a crash loop, where every worker's first
      # request may be the fatal one) so takes down the connection it died
      # on, not the whole backlog it had taken in first; and its share keeps
      # the backlog moving when requests that never yield have pushed the
      # adaptive limit down to a slot or two. Past its share it stops once a
      # sibling serves {Handoff::MARGIN} fewer connections (#sibling_less_busy?): the
      # rest of the backlog is theirs (keep-alive clients that connect
      # together are spread as they arrive, and the Handoff evens out the rest).
      def take_in_after_first(listener)
        @scheduler.yield
        share = backlog_share(listener)
        taken = 1
        while !@context.stopping? && room_for_connection? && (share.positive? || (room? && !sibling_less_busy?)) &&
              (socket = accept_now(listener))
          open_connection(socket, listener)
          share -= 1
          taken = pace(taken + 1, listener)
        end
      end

      # Whether a sibling serves {Handoff::MARGIN} fewer connections than this
      # worker (never without a {Handoff}).
      def sibling_less_busy?
        (handoff = @context.handoff) ? handoff.sibling_less_busy? : false
      end

      # This worker's share of the connections waiting in `listener`'s
      # backlog: the backlog over the workers, rounded up (0 where it cannot
      # be read: a unix socket).
      def backlog_share(listener)
        waiting = listener.pending_connections or return 0

        (waiting + @workers - 1) / @workers
      end

      # A connection queued at a stop with no room for it: told to retry (no
      # request was read; plain HTTP only, a TLS client just sees the close).
      def refuse_at_stop(socket, listener)
        unless listener.tls
          socket.write_nonblock(STOPPING_RESPONSE, exception: false)
          socket.read_nonblock(Connection::READ_SIZE, exception: false) # a close with unread bytes is a reset, which may beat the 503
        end
      rescue SystemCallError, IOError
        nil
      ensure
        socket.close
      end

      # Out of file descriptors or kernel memory, accept fails and the
      # connection stays in the backlog: wait a little, then try again
      # (logged at most once a second).
      def accept_now(listener)
        listener.accept_now
      rescue Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM => e
        clock = Clock.now
        if @accept_failed_at.nil? || clock - @accept_failed_at >= 1
          @accept_failed_at = clock
          NeverBlock.logger.warn("NeverBlock::Server: accept failed (#{e.message}) with #{@connections.size} " \
                                 "connections open; lower max_connections or raise the open-file limit (ulimit -n)")
        end
        NeverBlock.sleep(0.1)
        nil
      end

      def room?
        !@admission.full? && room_for_connection? && (alone? || @admission.taken + @starting < @admission.limit)
      end

      # Whether this is the listener's only worker (none beside it to leave
      # connections in the backlog to).
      def alone?
        @workers <= 1
      end

      # @param held [Integer] connections accepted but not counted yet (#start_held).
      def room_for_connection?(held = 0)
        @connections.size + held < @limits.max_connections && !@pool.full?
      end

      # The request slots are all taken, but there is room for a connection:
      # waits for a turn among the requests waiting for a slot
      # (Admission#wait_turn), so connections in the accept queue are not
      # starved by the keep-alive connections already accepted. Counted as an
      # acceptor waiting for room (#pending_connections) meanwhile.
      def wait_turn
        @turn_waiters += 1
        @admission.wait_turn
        true
      ensure
        @turn_waiters -= 1
      end

      # Returns whether it waited a turn (#wait_turn) rather than for room.
      def wait_for_room
        return false if room?
        return wait_turn if @admission.full? && room_for_connection?

        wait_until { room? }
        false
      end

      # Waits, as an acceptor waiting for room (woken by #room_freed), until
      # the block is true.
      def wait_until(&condition)
        fiber = Fiber.current
        @waiters << fiber
        @scheduler.wait_until(&condition)
      ensure
        @waiters.delete(fiber)
      end

      # A new connection (accepted, or handed over by a sibling) gets a task.
      def open_connection(socket, listener)
        connection = Connection.new(@context, socket, listener)
        @connections[connection] = true
        @starting += 1
        ran = scheduled = false
        scheduled = spawn_for(connection) do
          ran = true
          started
          connection.run
        end
        @context.handoff&.publish
      ensure
        started unless ran || scheduled
      end

      # Gives `connection` a pooled task that starts on the loop's next turn
      # (FiberPool#spawn(defer: true): after this returns), runs the block,
      # and finishes the connection unless it parked. The task is a root of
      # the server's own, in the app's scope ({AppTasks#enclose}). When Ruby
      # cannot create the fiber (the task failed and was logged) or the
      # spawn raises, the connection is finished here.
      # @return [Boolean] whether the task will run.
      def spawn_for(connection, &block)
        task = @pool.spawn(defer: true, detached: true, internal: true) do
          block.call
        ensure
          close_connection(connection) unless connection.parked?
        end
        connection.task = @app_tasks.enclose(task)
        return true if connection.task.alive?

        close_connection(connection)
        false
      rescue StandardError
        close_connection(connection)
        raise
      end

      # A connection's fiber started (or will not): it no longer counts
      # against the slots an acceptor beside other workers may fill (#room?).
      def started
        @starting -= 1
        room_freed
      end

      # The receiving task of a worker in a {Handoff}: serves each connection a
      # sibling hands over as if it had accepted it, while it has room for a
      # connection (the request slots are not asked: the sibling chose this
      # worker as the least busy, and a request that finds them taken waits
      # for one as any other). It goes on while the worker drains (a stopping
      # worker answers the request a moved connection brought, with
      # `connection: close`), until #take_last_handoffs. If it dies, the slot
      # closes with it.
      def receive_handoffs
        loop do
          wait_until { room_for_connection? } unless room_for_connection?
          socket, listener = @handoff.receive
          socket ? open_connection(socket, listener) : @handoff.wait_readable
        end
      ensure
        @handoff.close
      end

      # At the end of the drain: the receiver stops, and what siblings sent
      # before this worker closed its slot is served too (each connection
      # brought a request; it is answered with `connection: close`). What
      # comes later (a sibling that read the slot just before it closed) is
      # the index's successor's, or, if none comes, waits in the pair until
      # the master exits.
      def take_last_handoffs
        return unless @receiver

        @receiver.cancel
        while (received = @handoff.receive)
          room_for_connection? ? open_connection(*received) : received.first.close
        end
      end
    end
  end
end
