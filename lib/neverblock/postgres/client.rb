# frozen_string_literal: true

module NeverBlock
  module Postgres
    # Raised by {Client#transaction} when the block finished but the
    # transaction had failed inside it (an SQL error the block rescued):
    # PostgreSQL rolled it back instead of committing.
    class TransactionRolledBack < NeverBlock::BaseError
    end

    # A pipelined statement was sent, and its connection was lost before its
    # result came back (the server restarted, the backend was terminated):
    # whether it ran, and outside a transaction committed, is unknown. Every
    # statement in flight on the lost connection gets this one error class,
    # whatever libpq said (its message is in the text and in `cause`). A
    # `PG::ConnectionBad`, so code that handles lost connections handles it,
    # and a {NeverBlock::Error}. Do not blindly retry a statement that is
    # not idempotent.
    class OutcomeUnknown < PG::ConnectionBad
      include NeverBlock::Error
    end

    # A pool of PostgreSQL connections with a query interface; made by
    # {Postgres.pool}. Thread- and fiber-safe: share one per process.
    #
    # Every call takes a connection for its own duration only, except
    # {#transaction} and {#with}, which pin one connection to the calling
    # fiber for the block (calls on the client inside the block use it too),
    # and pipelined calls, whose connection stays with its lane while any
    # statement is in flight on it.
    class Client
      # Errors that leave a connection unusable, beyond those the pool knows.
      BROKEN_ON = (ConnectionPool::BROKEN_ON + [PG::ConnectionBad, PG::UnableToSend]).freeze

      # Closes a connection the pool gives up (finish is quick: no round trip).
      CLOSE = ->(conn) { conn.finish unless conn.finished? }

      # In a forked child: points the parent's connection's socket at
      # /dev/null, so that pg's finalizer in the child (PQfinish sends a
      # Terminate message) cannot end the parent's session.
      FORGET = ->(conn) { conn.socket_io.reopen(IO::NULL) unless conn.finished? }

      # The spans' db.system.
      SYSTEM = "postgresql"

      DEFER = ConnectionPool::DEFER
      ALLOW = ConnectionPool::ALLOW
      private_constant :DEFER, :ALLOW, :CLOSE, :FORGET

      # Seconds a connection must have been back in the pool before it is
      # health-checked again (see #healthy?). One that came back less than
      # this ago was just used: checking it would cost every query a system
      # call, in a busy pool where connections come back within
      # milliseconds; if its session ended meanwhile, the next query on it
      # fails with PG::ConnectionBad and it is replaced.
      HEALTH_CHECK_AFTER = 0.1

      # @return [ConnectionPool] the pool of `PG::Connection`s.
      attr_reader :pool

      # @param connector [Connector] opens connections.
      # @param size [Integer]
      # @param timeout [Numeric] seconds to wait for a free connection.
      # @param pipeline [Boolean] see {Postgres.pool}.
      # @param pipeline_depth [Integer] see {Postgres.pool}.
      # @param opentelemetry [Boolean] see {Postgres.pool}.
      def initialize(connector, size:, timeout:, pipeline: false, pipeline_depth: 16, opentelemetry: false)
        Telemetry.require_api!("NeverBlock::Postgres.pool") if opentelemetry
        @opentelemetry = opentelemetry ? true : false
        @connector = connector
        @pipeline = pipeline ? true : false
        @pipeline_depth = NeverBlock.validate_size!(pipeline_depth, :pipeline_depth)
        @pool = ConnectionPool.new(size: size, timeout: timeout, broken_on: BROKEN_ON, close: CLOSE,
                                   healthy: method(:healthy?), check_after: HEALTH_CHECK_AFTER, forget: FORGET,
                                   name: "postgres") { connector.call.tap { |conn| conn.pool = @pool } }
        @held_key = :"__neverblock_pg_held_#{object_id}"
        @transaction_key = :"__neverblock_pg_transaction_#{object_id}"
        @lanes_key = :"__neverblock_pg_lanes_#{object_id}"
      end

      # @return [Boolean] whether statements are pipelined.
      def pipeline?
        @pipeline
      end

      # Runs `sql` (one statement when pipelined; several separated by `;`
      # otherwise).
      #
      # @param sql [String]
      # @return [PG::Result]
      # @raise [PG::Error] the server's error (the connection stays usable),
      #   or a connection error (the connection is replaced).
      # @raise [PoolTimeout] when no connection is free in time.
      def exec(sql)
        return Telemetry.query_span(SYSTEM, sql, text: false) { run(sql, nil, 0) } if @opentelemetry

        run(sql, nil, 0)
      end

      # Runs one statement with `$1`-style parameters, sent apart from the SQL.
      #
      # @param sql [String]
      # @param params [Array] values, or hashes with :value, :type, :format.
      # @param result_format [Integer] 0 for text results, 1 for binary.
      # @return [PG::Result]
      # @raise (see #exec)
      def exec_params(sql, params, result_format = 0)
        return Telemetry.query_span(SYSTEM, sql, text: true) { run(sql, params, result_format) } if @opentelemetry

        run(sql, params, result_format)
      end

      # Runs the block in a transaction on one connection: COMMIT when it
      # returns, ROLLBACK when it raises (the error propagates). Calls on the
      # client inside the block run in the transaction; a nested
      # `transaction` joins the outer one.
      #
      # @param isolation [Symbol, nil] :serializable, :repeatable_read,
      #   :read_committed (default: the server's).
      # @param read_only [Boolean]
      # @yieldparam conn [PG::Connection]
      # @return [Object] the block's value.
      # @raise [TransactionRolledBack] if an SQL error inside the block was
      #   rescued, so that PostgreSQL could only roll back.
      def transaction(isolation: nil, read_only: false)
        with do |conn|
          next yield(conn) if Thread.current[@transaction_key]

          conn.exec(begin_statement(isolation, read_only))
          Thread.current[@transaction_key] = true
          begin
            value = yield(conn)
            if conn.transaction_status == PG::PQTRANS_INERROR
              conn.exec("ROLLBACK")
              raise TransactionRolledBack, "an error inside the transaction was rescued, so it was rolled back " \
                                           "instead of committed; let the error propagate or use a savepoint"
            end
            conn.exec("COMMIT")
            value
          rescue Exception # rubocop:disable Lint/RescueException -- re-raised
            # Roll back here, not only when the connection goes back: an
            # outer #with may lend it on. (If this fails, #with closes it.)
            roll_back_quietly(conn)
            raise
          ensure
            Thread.current[@transaction_key] = nil
          end
        end
      end

      # Lends the calling fiber a connection for the block: for COPY,
      # prepared statements, cursors, anything pg can do. Re-entrant. If the
      # block leaves a query running or a transaction open (an exception, a
      # timeout), the query is cancelled on the server and the transaction
      # rolled back before the connection goes back to the pool; a
      # connection that cannot be restored is closed.
      #
      # @yieldparam conn [PG::Connection]
      # @return [Object] the block's value.
      # @raise [PoolTimeout] when no connection is free in time.
      def with
        if (held = held_connection)
          return yield(held)
        end
        return lend { |conn| yield(conn) } unless ConnectionPool.masks_needed?

        Thread.handle_interrupt(DEFER) do
          lend { |conn| Thread.handle_interrupt(ALLOW) { yield(conn) } }
        end
      end

      # Listens on PostgreSQL channels (LISTEN/NOTIFY) on a connection of its
      # own, calling the block for every notification until the block
      # breaks or the calling task is cancelled. Inside NeverBlock only the
      # calling fiber waits.
      #
      # A notification sent before the LISTEN took effect is not delivered:
      # `ready:` is called once it has, e.g. to let the code that notifies
      # go on (`ready: -> { listening << true }`).
      #
      # @param channels [Array<String>]
      # @param timeout [Numeric, nil] return nil after this many seconds
      #   without a notification (default: wait forever).
      # @param ready [#call, nil] called (with no argument) once every
      #   channel is listened to, before the first wait.
      # @yieldparam payload [String]
      # @yieldparam channel [String]
      # @yieldparam pid [Integer] the notifying backend.
      # @return [Object] the value of a `break`, or nil after `timeout`.
      def listen(*channels, timeout: nil, ready: nil)
        raise ArgumentError, "listen needs at least one channel" if channels.empty?
        raise ArgumentError, "listen needs a block" unless block_given?

        timeout = NeverBlock.validate_timeout!(timeout, :timeout) if timeout
        conn = @connector.call
        begin
          channels.each { |channel| conn.exec("LISTEN #{conn.quote_ident(channel.to_s)}") }
          ready&.call
          loop do
            # pg passes no payload for an empty one: "" as documented.
            got = conn.wait_for_notify(timeout) { |channel, pid, payload| yield(payload || "", channel, pid) }
            return nil if got.nil? && timeout
            raise PG::ConnectionBad, "connection lost while listening" if conn.status != PG::CONNECTION_OK
          end
        ensure
          conn.finish unless conn.finished?
        end
      end

      # Sends a notification (`pg_notify`).
      # @param channel [String]
      # @param payload [String]
      # @return [void]
      def notify(channel, payload = "")
        exec_params("SELECT pg_notify($1, $2)", [channel.to_s, payload.to_s])
        nil
      end

      # @return [Hash] the pool's `{size:, in_use:, idle:, waiting:}`, plus
      #   `lanes:` (pipelined connections in use on this thread).
      def stats
        stats = @pool.stats
        stats[:lanes] = lanes_state.lanes.size if @pipeline
        stats
      end

      # Closes idle connections now and the others when they come back.
      # @return [void]
      def disconnect_all
        @pool.disconnect_all
      end
      alias close disconnect_all

      # @return [String]
      def inspect
        "#<#{self.class.name} #{@connector.inspect} #{stats.map { |k, v| "#{k}=#{v}" }.join(' ')}>"
      end

      private

      # Pipelined unless the fiber holds a connection (transaction, with) or
      # there is no fiber scheduler (plain threads: nothing to multiplex).
      def pipelining?
        @pipeline && !held_connection && Fiber.scheduler && !Fiber.current.blocking?
      end

      # The connection this fiber holds through #with, unless it is a
      # parent's connection seen from a forked child.
      def held_connection
        held = Thread.current[@held_key] or return nil
        held[1] if held[0] == @pool.epoch
      end

      # Checkout, the block, checkin: the body of #with. The fiber's
      # [epoch, connection] record of what it holds is made once per fiber
      # and reused.
      def lend
        conn = @pool.checkout_deferred
        held = (Thread.current[@held_key] ||= [nil, nil])
        held[0] = @pool.epoch
        held[1] = conn
        begin
          yield(conn)
        ensure
          held[1] = nil
          give_back(conn)
        end
      end

      # Back to the pool when idle or restored (even if the restore is
      # interrupted: then the connection is closed); otherwise closed.
      def give_back(conn)
        clean = false
        begin
          clean = idle?(conn) || restored?(conn)
        ensure
          clean ? @pool.checkin_deferred(conn) : @pool.discard_deferred(conn) # (interrupts deferred by the caller)
        end
      end

      # The least loaded lane of this thread; a new one when that one has
      # `pipeline_depth` statements in flight and the pool has room. When
      # the pool is full and lanes are still being opened, waits for them
      # rather than queueing for the pool. When others wait for the
      # pool (say for a transaction), lanes are closed so that their
      # connections come back.
      # One statement, pipelined or on a connection of its own (params nil:
      # sent as text, which may hold several statements).
      def run(sql, params, result_format)
        return lane_exec(sql, params, result_format) if pipelining?

        with { |conn| params ? conn.exec_params(sql, params, result_format) : conn.exec(sql) }
      end

      def lane_exec(sql, params, result_format)
        state = lanes_state
        # (`while`, not `loop`: returning from a block allocates.)
        while true # rubocop:disable Style/InfiniteLoop
          lanes = state.lanes
          lanes.dup.each(&:close) if @pool.waiting > state.opening
          lane = least_loaded(lanes)
          room = @pool.room?
          if lane.nil? && !room && state.opening.positive?
            wait_for_lane(state)
            next
          end
          lane = open_lane(state) if lane.nil? || (lane.load >= @pipeline_depth && room)
          return lane.exec(sql, params, result_format)
        end
      end

      # (Enumerable#min_by allocates twice a call; this runs per statement.)
      def least_loaded(lanes)
        least = nil
        lanes.each { |lane| least = lane if least.nil? || lane.load < least.load }
        least
      end

      # Lanes of one thread, how many of its fibers are opening one (they
      # may wait for the pool, and must not make the lanes close), and the
      # fibers waiting for those.
      LaneState = Struct.new(:epoch, :lanes, :opening, :waiting)
      private_constant :LaneState

      def open_lane(state)
        state.opening += 1
        begin
          lane = Lane.new(@pool, ->(closed) { state.lanes.delete(closed) })
          state.lanes << lane
          lane
        ensure
          state.opening -= 1
          state.waiting.slice!(0..).each { |queue| queue << true }
        end
      end

      def wait_for_lane(state)
        queue = Thread::Queue.new
        state.waiting << queue
        queue.pop
      ensure
        state.waiting.delete(queue)
      end

      # This thread's lanes (reset in a forked child, where the pool's epoch
      # moves on; cheaper than asking for the pid on every statement).
      def lanes_state
        state = Thread.current.thread_variable_get(@lanes_key)
        return state if state&.epoch == @pool.epoch

        Thread.current.thread_variable_set(@lanes_key, LaneState.new(@pool.epoch, [], 0, []))
      end

      def idle?(conn)
        !conn.finished? && conn.status == PG::CONNECTION_OK && conn.transaction_status == PG::PQTRANS_IDLE
      end

      # Cancels a query in flight and rolls back; a second interrupt meanwhile
      # must not replace the error being raised.
      def roll_back_quietly(conn)
        Recovery.restore(conn)
      rescue StandardError
        nil
      end

      def restored?(conn)
        return false if conn.finished? # the interrupted query's recovery gave it up (Recovery.cancel_interrupted)

        if conn.status == PG::CONNECTION_OK && conn.transaction_status == PG::PQTRANS_INTRANS && !$!
          NeverBlock.logger.warn("NeverBlock") { "a transaction was left open on a pooled connection; rolled back" }
        end
        Recovery.restore(conn)
      end

      # Cheap check of an idle connection before it is lent again (once it
      # has been back in the pool HEALTH_CHECK_AFTER seconds): reads whatever
      # the server sent meanwhile without waiting (a checkout never yields
      # here). A server ending the session (pg_terminate_backend, shutdown)
      # sends a FATAL error and then closes; libpq hands the error, which
      # arrives while idle, to the notice receiver, and may not have seen the
      # close yet.
      def healthy?(conn)
        return false unless idle?(conn)
        # Nothing arrived since the connection was last used (one peek at
        # the socket, no allocation): no error, no close, nothing to read.
        return true if conn.socket_io.recv_nonblock(1, Socket::MSG_PEEK, exception: false) == :wait_readable

        fatal = false
        previous = conn.set_notice_receiver { |result| fatal ||= result.error_field(PG::PG_DIAG_SEVERITY_NONLOCALIZED) == "FATAL" }
        begin
          conn.consume_input
          conn.is_busy
        ensure
          previous ? conn.set_notice_receiver(&previous) : conn.set_notice_receiver
        end
        !fatal && conn.status == PG::CONNECTION_OK
      end

      def begin_statement(isolation, read_only)
        sql = +"BEGIN"
        sql << " ISOLATION LEVEL " << Isolation.sql(isolation) if isolation
        sql << " READ ONLY" if read_only
        sql
      end
    end
  end
end
