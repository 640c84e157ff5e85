# frozen_string_literal: true

require "trilogy"

require_relative "connection"

module NeverBlock
  module MySQL
    # A Trilogy session. Trilogy does all of its waiting — the TCP connect
    # and DNS (Ruby's TCPSocket, so the scheduler's hooks), the handshake,
    # every reply — through `rb_wait_for_single_fd`, which a fiber scheduler
    # serves: nothing here blocks the loop but the C code that parses a
    # reply. Connecting still runs on the thread pool (see `connect`
    # below). An exception raised at one of those waits (a timeout, a
    # cancellation) makes Trilogy close its socket: an interrupted session
    # is never reused, it is killed on the server and replaced.
    class TrilogyConnection < Connection
      # ER_LOCK_WAIT_TIMEOUT: Trilogy makes it a connection error (a
      # Trilogy::TimeoutError), but the session is fine.
      LOCK_WAIT_TIMEOUT = 1205

      class << self
        # @return [Symbol]
        def driver
          :trilogy
        end

        # Connects on NeverBlock's thread pool, like {Mysql2Connection.open}
        # (`connect` below says why); only the calling fiber waits. A
        # session that arrives after the caller gave up is closed.
        #
        # @param config [Hash] Trilogy.new options.
        # @return [TrilogyConnection]
        def open(config)
          open_off_loop { connect(config) }
        end

        # @return [Array<Module>]
        def errors
          [::Trilogy::Error]
        end

        # @return [Integer, nil]
        def error_code(error)
          error.error_code if error.respond_to?(:error_code)
        end

        private

        # Trilogy waits on its socket through the scheduler, so connecting
        # on the loop would work, but it is not safe there: Trilogy.new
        # waits for the TCP connect on a Ruby socket (registered with the
        # loop's epoll), dup()s its descriptor and closes the original. When
        # the handshake needs no wait in between, the close comes before the
        # selector has dropped its registration, and the kernel keeps it,
        # since the dup holds the socket open: from then on the loop spins
        # on that stale registration, and reports the connection's traffic
        # as readiness of whatever new descriptor reuses the number (a
        # mysql2 socket, whose blocking read then holds the loop). On a
        # thread without a scheduler nothing is registered.
        #
        # Trilogy.new, in two steps: when the handshake fails (a wrong
        # password, a server shutting down) Trilogy keeps its socket open
        # until the object is garbage-collected; holding the object lets us
        # close it at once.
        def connect(config)
          raw = ::Trilogy.allocate
          raw.send(:initialize, config.dup) # Trilogy#initialize writes into its options
          new(raw, raw.query("SELECT CONNECTION_ID()").rows.first.first)
        rescue Exception # rubocop:disable Lint/RescueException -- close what was opened, then fail
          close_quietly(raw)
          raise
        end

        def close_quietly(raw)
          raw&.close
        rescue ::Trilogy::Error, IOError, SystemCallError
          nil
        end
      end

      # @param sql [String]
      # @return [Trilogy::Result]
      # @raise [ArgumentError] for options: Trilogy's query takes none.
      def query(sql, **options)
        raise ArgumentError, "Trilogy's query takes no options (got #{options.keys.join(', ')})" unless options.empty?

        @busy = true
        result = @raw.query(sql)
        @busy = false
        result
      rescue ::Trilogy::TimeoutError => e
        # read_timeout: the statement may still run (a lock wait timeout,
        # 1205, is the server's answer).
        @busy = false if e.error_code
        raise
      rescue ::Trilogy::Error
        @busy = false # the server answered with an error, or the session is gone
        raise
      end

      # @return [Boolean]
      def usable?
        !@raw.closed? && @raw.check
      rescue ::Trilogy::Error, IOError, SystemCallError
        false
      end

      # @return [Boolean] from the server status of the last reply.
      def in_transaction?
        @raw.in_transaction?
      rescue ::Trilogy::Error, IOError
        false
      end

      # @return [Boolean]
      def pending_results?
        @raw.more_results_exist?
      rescue ::Trilogy::Error, IOError
        false
      end

      # @return [void]
      def abandon_results
        @raw.abandon_results!
        nil
      end

      # @return [Boolean]
      def broken_by?(error)
        error.is_a?(::Trilogy::ConnectionError) && self.class.error_code(error) != LOCK_WAIT_TIMEOUT
      end

      # @return [void]
      def close
        @raw.close
      rescue ::Trilogy::Error, IOError, SystemCallError
        nil
      end
    end
  end
end
