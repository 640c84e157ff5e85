# frozen_string_literal: true

require "timeout"

module NeverBlock
  module MySQL
    # Brings a connection whose user stopped half-way (a timeout or a
    # cancellation during a query, an exception inside a transaction) back
    # to an idle state, so that it can go back to the pool, or says that it
    # cannot be (then the pool closes it).
    #
    # A statement that may still be running on the server is stopped with
    # `KILL QUERY <thread id>` from a separate, short-lived session (see
    # {Client}): closing the socket would not stop it, MariaDB runs a query
    # to its end whether or not anyone is left to read the result. Then its
    # reply is read and dropped where the driver still can (mysql2), and an
    # open transaction is rolled back. Everything is bounded by
    # `RECOVERY_TIMEOUT`.
    module Recovery
      # Seconds a kill plus drain, or a ROLLBACK, may take before the
      # connection is given up.
      RECOVERY_TIMEOUT = 5.0

      # Seconds the session that sends `KILL QUERY` may take to connect.
      KILL_CONNECT_TIMEOUT = 2

      # ER_NO_SUCH_THREAD: the session to kill has already gone.
      NO_SUCH_THREAD = 1094

      # Raised when recovery runs out of time; never escapes {.restore}.
      class Expired < StandardError
      end
      private_constant :Expired

      module_function

      # @param conn [Connection] the connection, still held by the caller.
      # @param error [Exception, nil] what ended the caller's use of it.
      # @param kill [#call] called with a thread id: `KILL QUERY` it from
      #   another session.
      # @return [Boolean] true when `conn` is idle and may be lent again.
      def restore(conn, error, kill)
        if error.nil? && !conn.busy? && !conn.pending_results?
          # The common case: only a transaction left open needs work.
          return true unless conn.in_transaction?

          NeverBlock.logger.warn("NeverBlock") do
            "a transaction was left open on a pooled MySQL connection; rolled back"
          end
        end
        # Inside a pooled checkout other interrupts wait (handle_interrupt);
        # this time limit must not, on a plain thread.
        Thread.handle_interrupt(Expired => :immediate) do
          Timeout.timeout(RECOVERY_TIMEOUT, Expired) { recover(conn, error, kill) }
        end
      rescue Expired, IOError, SystemCallError, *conn.class.errors => e
        NeverBlock.logger.debug("NeverBlock") { "a MySQL connection could not be restored: #{e.class}: #{e.message}" }
        false
      end

      # With the time limit running.
      def recover(conn, error, kill)
        interrupted = error && !conn.driver_error?(error)
        # Busy: we sent a statement and were interrupted before its reply.
        # Interrupted and unusable: the driver closed the socket under a
        # statement the caller ran on the raw connection.
        if conn.busy? || (interrupted && !conn.usable?)
          kill.call(conn.thread_id)
          return false unless conn.finish_interrupted(Clock.now + RECOVERY_TIMEOUT)
        end
        return false if error && conn.driver_error?(error) && conn.broken_by?(error)
        # Before looking at the socket: unread results may be waiting there.
        conn.abandon_results if conn.pending_results?
        return false unless conn.usable?

        transaction = conn.in_transaction?
        # nil: the server cannot tell; ROLLBACK outside a transaction does nothing.
        conn.query("ROLLBACK") if transaction || (transaction.nil? && error)
        conn.transaction = false
        true
      end

      # Stops the statement running in session `thread_id` from a new
      # session (one attempt, then closed). Failing, it logs a warning and
      # returns: the caller's own error is the one worth raising.
      #
      # @param connection_class [Class<Connection>] the driver to use.
      # @param config [Hash] connection options, see {.kill_config}.
      # @param thread_id [Integer] the server's id of the session.
      # @return [void]
      def kill_query(connection_class, config, thread_id)
        killer = connection_class.open(config)
        killer.query("KILL QUERY #{Integer(thread_id)}")
        nil
      rescue *connection_class.errors, IOError, SystemCallError => e
        return if connection_class.error_code(e) == NO_SUCH_THREAD

        NeverBlock.logger.warn("NeverBlock") do
          "could not stop MySQL thread #{thread_id} with KILL QUERY: #{e.class}: #{e.message}"
        end
      ensure
        killer&.close
      end

      # @param config [Hash] the pool's connection options.
      # @return [Hash] the same, with a connect timeout of at most
      #   KILL_CONNECT_TIMEOUT seconds.
      def kill_config(config)
        timeout = config[:connect_timeout]
        config.merge(connect_timeout: timeout ? [timeout, KILL_CONNECT_TIMEOUT].min : KILL_CONNECT_TIMEOUT)
      end
    end
  end
end
