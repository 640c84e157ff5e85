# frozen_string_literal: true

module NeverBlock
  module Postgres
    # Brings a connection whose user stopped half-way (a timeout or
    # cancellation during a query, an exception inside a transaction) back
    # to an idle state, so that it can go back to the pool, or says that it
    # cannot be (then the pool closes it).
    #
    # A query still running is cancelled on the server (libpq's cancel
    # request, sent without blocking the loop by pg >= 1.5) and its results
    # read and dropped; an open transaction is rolled back. Everything is
    # bounded by `RECOVERY_TIMEOUT`.
    #
    # PostgreSQL drops a cancel that reaches the backend before it has read
    # the query (it cancels only a statement running): the query sent just
    # before the interrupt, on a loaded machine, then runs on. So while the
    # query runs on, the cancel is sent again, `CANCEL_AGAIN` seconds after
    # the first and then at twice the last interval, while that is within
    # `RECOVERY_TIMEOUT` (each cancel is a connection the postmaster forks
    # a process for: three at most).
    module Recovery
      # Seconds a cancel plus drain, or a ROLLBACK, may take before the
      # connection is given up.
      RECOVERY_TIMEOUT = 5.0

      # Seconds after a cancel before it is sent again (then doubling).
      CANCEL_AGAIN = 0.5

      module_function

      # @param conn [PG::Connection]
      # @return [Boolean] true when `conn` is idle and usable again.
      def restore(conn)
        return false if conn.finished? || conn.status != PG::CONNECTION_OK

        deadline = Clock.now + RECOVERY_TIMEOUT
        if conn.transaction_status == PG::PQTRANS_ACTIVE
          return false if conn.pipeline_status != PG::PQ_PIPELINE_OFF

          conn.cancel
          return false unless drain(conn, deadline, cancelling: true)
        end
        case conn.transaction_status
        when PG::PQTRANS_IDLE then true
        when PG::PQTRANS_INTRANS, PG::PQTRANS_INERROR then roll_back(conn, deadline)
        else false
        end
      rescue PG::Error, IOError, SystemCallError
        false
      end

      # After an interrupt (not an SQL error) escaped a query method: cancels
      # the query still running and drops its results, leaving a transaction
      # that was open before the query as it is, but rolling back one the
      # query opened (the caller saw the query fail); closes the connection
      # if that fails.
      # @param conn [PG::Connection]
      # @param before [Integer] its transaction status before the query
      #   (PG::PQTRANS_*); nil when unknown.
      # @return [void]
      def cancel_interrupted(conn, before = nil)
        return if conn.finished? || conn.status != PG::CONNECTION_OK
        return if conn.pipeline_status != PG::PQ_PIPELINE_OFF

        deadline = Clock.now + RECOVERY_TIMEOUT
        if conn.transaction_status == PG::PQTRANS_ACTIVE
          conn.cancel
          conn.pool&.query_cancelled if conn.respond_to?(:pool)
          return conn.finish unless drain(conn, deadline, cancelling: true)
        end
        return unless before == PG::PQTRANS_IDLE && conn.transaction_status != PG::PQTRANS_IDLE

        conn.finish unless roll_back(conn, deadline)
      rescue PG::Error, IOError, SystemCallError
        conn.finish unless conn.finished?
      end

      # Reads and drops the results of the query in flight; `cancelling`
      # (a cancel was sent) sends it again while the query runs on.
      # @return [Boolean] false if the server did not finish in time.
      def drain(conn, deadline, cancelling: false)
        interval = CANCEL_AGAIN
        cancel_again = Clock.now + interval if cancelling
        loop do
          while conn.is_busy
            now = Clock.now
            remaining = deadline - now
            return false if remaining <= 0

            cancel_again = nil if cancel_again && cancel_again >= deadline
            if conn.socket_io.wait_readable(cancel_again ? (cancel_again - now).clamp(0..) : remaining)
              conn.consume_input
            elsif cancel_again && Clock.now >= cancel_again
              conn.cancel
              interval *= 2
              cancel_again = Clock.now + interval
            end
          end
          result = conn.sync_get_result or return true
          status = result.result_status
          result.clear
          # COPY in progress: not worth untangling; the connection goes.
          return false if [PG::PGRES_COPY_IN, PG::PGRES_COPY_OUT, PG::PGRES_COPY_BOTH].include?(status)
        end
      end

      def roll_back(conn, deadline)
        conn.send_query("ROLLBACK")
        drain(conn, deadline) && conn.transaction_status == PG::PQTRANS_IDLE
      end
    end
  end
end
