# frozen_string_literal: true

module NeverBlock
  module MySQL
    # A pool of MySQL/MariaDB connections through Trilogy or mysql2, with a
    # query interface; made by {MySQL.pool}. Thread- and fiber-safe: share
    # one per process.
    #
    # Every call takes a connection for its own duration only, except
    # {#transaction} and {#with}, which pin one connection to the calling
    # fiber for the block (calls on the client inside the block use it too).
    #
    # When a call is interrupted while its statement runs (a
    # {NeverBlock.timeout}, `Timeout.timeout`, {Task#cancel}), the statement
    # is stopped on the server with `KILL QUERY` before the exception goes
    # on, and the connection is restored or replaced ({Recovery}): the pool
    # never lends a connection in the middle of a reply.
    class Client
      CLOSE = ->(conn) { conn.close }
      HEALTHY = ->(conn) { conn.healthy? }
      DEFER = ConnectionPool::DEFER
      ALLOW = ConnectionPool::ALLOW
      private_constant :CLOSE, :HEALTHY, :DEFER, :ALLOW

      # @return [ConnectionPool] the pool of {Connection}s (each wraps a
      #   driver connection; {#with} lends the driver's).
      attr_reader :pool

      # @param connection_class [Class<Connection>] the driver's {Connection}.
      # @param config [Hash] the driver's connection options (for the
      #   sessions that send `KILL QUERY`).
      # @param connector [Connector] opens pooled connections.
      # @param size [Integer]
      # @param timeout [Numeric] seconds to wait for a free connection.
      def initialize(connection_class, config, connector, size:, timeout:, opentelemetry: false)
        Telemetry.require_api!("NeverBlock::MySQL.pool") if opentelemetry
        @opentelemetry = opentelemetry ? true : false
        @connection_class = connection_class
        @connector = connector
        kill_config = Recovery.kill_config(config)
        # The client checks connections in or discards them itself; for
        # `pool.with` the pool's defaults apply (an SQL error must not make
        # it discard a connection), and the health check catches the rest.
        @pool = ConnectionPool.new(size: size, timeout: timeout, close: CLOSE,
                                   healthy: HEALTHY, name: "mysql") { connector.call }
        @held_key = :"__neverblock_mysql_held_#{object_id}"
        @kill = lambda do |thread_id|
          @pool.query_cancelled
          Recovery.kill_query(connection_class, kill_config, thread_id)
        end
      end

      # @return [Symbol] :trilogy or :mysql2.
      def driver
        @connection_class.driver
      end

      # Runs `sql` (one statement). Inside NeverBlock only the calling fiber
      # waits for the reply.
      #
      # @param sql [String]
      # @param options [Hash] mysql2 query options (as:, symbolize_keys:,
      #   cast:, ...); Trilogy takes none.
      # @return [Trilogy::Result, Mysql2::Result, nil] the driver's result.
      # @raise [Trilogy::Error, Mysql2::Error] the server's error (the
      #   connection stays usable), or a connection error (the connection is
      #   replaced).
      # @raise [PoolTimeout] when no connection is free in time.
      def query(sql, **options)
        return Telemetry.query_span("mysql", sql, text: false) { lend { |conn| conn.query(sql, **options) } } if @opentelemetry

        lend { |conn| conn.query(sql, **options) }
      end

      # Runs the block in a transaction on one connection: COMMIT when it
      # returns, ROLLBACK when it raises (the error propagates). Calls on the
      # client inside the block run in the transaction; a nested
      # `transaction` joins the outer one.
      #
      # Unlike PostgreSQL, MySQL keeps a transaction going after a failed
      # statement: one the block rescues does not stop the COMMIT.
      #
      # @param isolation [Symbol, nil] :serializable, :repeatable_read,
      #   :read_committed, :read_uncommitted (default: the server's).
      # @param read_only [Boolean]
      # @yieldparam conn [Trilogy, Mysql2::Client] the driver's connection.
      # @return [Object] the block's value.
      def transaction(isolation: nil, read_only: false)
        lend do |conn|
          next yield(conn.raw) if conn.transaction

          conn.query("SET TRANSACTION ISOLATION LEVEL #{Isolation.sql(isolation)}") if isolation
          conn.query(read_only ? "START TRANSACTION READ ONLY" : "START TRANSACTION")
          conn.transaction = true
          begin
            value = yield(conn.raw)
            conn.query("COMMIT")
            value
          rescue Exception => e # rubocop:disable Lint/RescueException -- re-raised
            # Roll back here (killing a statement in flight), not only when
            # the connection goes back: an outer #with may lend it on.
            roll_back_quietly(conn, e)
            raise
          ensure
            conn.transaction = false
          end
        end
      end

      # Lends the calling fiber the driver's connection for the block, for
      # anything the driver can do. Re-entrant. If the block is interrupted
      # while a statement runs, the statement is killed on the server; a
      # transaction it leaves open is rolled back; a connection that cannot
      # be restored is closed.
      #
      # With mysql2, prepared statements (`prepare`/`execute`), `stream:`
      # results and further results of multi-statement queries block the
      # thread, and so the loop, while they run: wrap them in
      # {NeverBlock.defer}, or use {#query}.
      #
      # @yieldparam conn [Trilogy, Mysql2::Client]
      # @return [Object] the block's value.
      # @raise [PoolTimeout] when no connection is free in time.
      def with
        lend do |conn|
          conn.lent!
          yield conn.raw
        end
      end

      # @return [Hash] the pool's `{size:, in_use:, idle:, waiting:}`.
      def stats
        @pool.stats
      end

      # Closes idle connections now and the others when they come back.
      # @return [void]
      def disconnect_all
        @pool.disconnect_all
      end
      alias close disconnect_all

      # @return [String]
      def inspect
        "#<#{self.class.name} #{driver} #{@connector.inspect} #{stats.map { |k, v| "#{k}=#{v}" }.join(' ')}>"
      end

      private

      # Yields the fiber's {Connection}: the one it holds, else one from the
      # pool, which gets it back restored (or discards it) afterwards.
      def lend
        held = Thread.current[@held_key]
        # A forked child must not use the parent's session.
        return yield(held[1]) if held && held[0] == @pool.epoch

        Thread.handle_interrupt(DEFER) do
          conn = @pool.checkout_deferred
          Thread.current[@held_key] = [@pool.epoch, conn]
          error = nil
          begin
            Thread.handle_interrupt(ALLOW) { yield(conn) }
          rescue Exception => e # rubocop:disable Lint/RescueException -- recorded for give_back, re-raised
            error = e
            raise
          ensure
            Thread.current[@held_key] = nil
            give_back(conn, error)
          end
        end
      end

      def give_back(conn, error)
        clean = false
        clean = Recovery.restore(conn, error, @kill)
      ensure
        conn.transaction = false
        conn.returned!
        clean ? @pool.checkin_deferred(conn) : @pool.discard_deferred(conn) # (interrupts deferred by the caller)
      end

      # Rolls back after the block of #transaction raised; a second
      # interrupt meanwhile must not replace the error being raised. A
      # connection that could not be restored is left for #lend to discard.
      def roll_back_quietly(conn, error)
        Recovery.restore(conn, error, @kill)
      rescue StandardError
        nil
      end
    end
  end
end
