# frozen_string_literal: true

module NeverBlock
  module MySQL
    # One server session as the pool holds it: the driver's connection
    # ({#raw}, what {Client#with} lends) plus what NeverBlock needs to look
    # after it — the server's id for the session (for `KILL QUERY`), whether
    # a statement was sent and its reply not read ({#busy?}), and whether a
    # transaction is open. One subclass per driver: {TrilogyConnection},
    # {Mysql2Connection}.
    #
    # Used by one fiber (or thread) at a time: the one the pool lent it to.
    class Connection
      # @return [Object] the driver's connection (Trilogy, Mysql2::Client).
      attr_reader :raw

      # @return [Integer] the server's id for this session (CONNECTION_ID()).
      attr_reader :thread_id

      # @return [Boolean] whether {Client#transaction} opened a transaction
      #   that is not committed yet.
      attr_accessor :transaction

      class << self
        # @return [Symbol] :trilogy or :mysql2.
        def driver
          raise NotImplementedError
        end

        # Opens a session, on NeverBlock's thread pool inside NeverBlock
        # (only the calling fiber waits).
        # @param config [Hash] driver options (host:, port:, username:, ...).
        # @return [Connection]
        def open(_config)
          raise NotImplementedError
        end

        # @return [Array<Module>] what the driver raises, for rescue.
        def errors
          raise NotImplementedError
        end

        # @param error [Exception] one of {.errors}.
        # @return [Integer, nil] the MySQL error number, when there is one.
        def error_code(_error)
          raise NotImplementedError
        end

        private

        # Runs `connect` (which returns a new {Connection}) on NeverBlock's
        # thread pool, where it may block, and waits for it in the calling
        # fiber only. A connection that arrives after the caller gave up (a
        # timeout, a cancellation) is closed. Outside NeverBlock it just
        # runs `connect`.
        def open_off_loop(&connect)
          return connect.call unless NeverBlock.neverblocking?

          handoff = Handoff.new
          NeverBlock.defer { handoff.put(connect.call) }
          handoff.take
        ensure
          handoff&.abandon
        end
      end

      # Carries a connection from a pool thread to the fiber that asked for
      # it, or closes it if that fiber left first.
      class Handoff
        def initialize
          @lock = Thread::Mutex.new
          @connection = nil
          @abandoned = false
        end

        # On the pool thread.
        def put(connection)
          late = @lock.synchronize do
            @connection = connection unless @abandoned
            @abandoned
          end
          connection.close if late
          nil
        end

        # @return [Connection]
        def take
          @lock.synchronize { @connection.tap { @connection = nil } }
        end

        # The waiting fiber leaves: a connection not taken is closed.
        def abandon
          connection = @lock.synchronize do
            @abandoned = true
            @connection.tap { @connection = nil }
          end
          connection&.close
        end
      end
      private_constant :Handoff

      # @param raw [Object] the driver's connection.
      # @param thread_id [Integer] the server's id for the session.
      def initialize(raw, thread_id)
        @raw = raw
        @thread_id = thread_id
        @busy = false
        @transaction = false
        @lent = false
      end

      # Runs `sql` and returns the driver's result. Inside NeverBlock only
      # the calling fiber waits for the reply. Interrupted while it waits
      # (a timeout, a cancellation), the statement stays {#busy?}.
      #
      # @param sql [String]
      # @param options [Hash] driver query options (mysql2 only).
      # @return [Object] the driver's result.
      def query(_sql, **_options)
        raise NotImplementedError
      end

      # @return [Boolean] true while a statement was sent and its reply was
      #   not read: it may still be running on the server.
      def busy?
        @busy
      end

      # @return [Boolean] whether the session can take another statement
      #   (costs one non-blocking system call, no round trip).
      def usable?
        raise NotImplementedError
      end

      # @return [Boolean] usable, idle and with nothing unexpected waiting on
      #   the socket (e.g. the EOF of a session the server closed while idle).
      def healthy?
        !busy? && usable?
      end

      # @return [Boolean, nil] whether a transaction is open; nil when the
      #   server cannot tell.
      def in_transaction?
        raise NotImplementedError
      end

      # @return [Boolean] whether a multi-statement query left results
      #   unread (no round trip).
      def pending_results?
        raise NotImplementedError
      end

      # Reads and drops the unread results of a multi-statement query.
      # @return [void]
      def abandon_results
        raise NotImplementedError
      end

      # After a `KILL QUERY`: reads and drops the reply of the interrupted
      # statement (an error, or the result if it finished first).
      # @param deadline [Float] monotonic seconds.
      # @return [Boolean] true when the session is idle and usable again.
      def finish_interrupted(_deadline)
        false
      end

      # @param error [Exception]
      # @return [Boolean] whether the driver raised `error`.
      def driver_error?(error)
        self.class.errors.any? { |type| type === error } # rubocop:disable Style/CaseEquality -- modules too
      end

      # @param error [Exception] raised by the driver.
      # @return [Boolean] whether `error` means the session is gone (the
      #   server closed it, the network failed), not that a statement failed.
      def broken_by?(_error)
        raise NotImplementedError
      end

      # Marks the driver connection as lent to code that may use it directly
      # (its transaction state is then the driver's business, see
      # {#in_transaction?}).
      # @return [void]
      def lent!
        @lent = true
      end

      # Called when the connection goes back to the pool.
      # @return [void]
      def returned!
        @lent = false
      end

      # Closes the session (quickly; no error escapes for a broken one).
      # @return [void]
      def close
        raise NotImplementedError
      end

      # @return [String]
      def inspect
        "#<#{self.class.name} thread_id=#{@thread_id}#{' busy' if @busy}#{' transaction' if @transaction}>"
      end
    end
  end
end
