# frozen_string_literal: true

require "io/wait"
require "socket"
require "mysql2"

require_relative "connection"

module NeverBlock
  module MySQL
    # A mysql2 session. mysql2 calls libmariadb with the GVL released, so
    # those calls block the thread — and with it the loop:
    #
    # - connecting (`mysql_real_connect`, DNS included) blocks for the whole
    #   handshake: {.open} runs it on NeverBlock's thread pool (defer), with
    #   `automatic_close: false` unless given;
    # - a query is sent with `async: true` (a blocking write, over at once
    #   unless the SQL outgrows the socket buffer), then only the calling
    #   fiber waits for the reply on the socket, then `async_result` reads
    #   it (blocking, but the reply has begun to arrive; a large result
    #   holds the loop while the rest of it streams in).
    #
    # mysql2's own `query` waits through the scheduler too, but when that
    # wait is interrupted it throws the socket away. Waiting here instead
    # keeps the session: after a timeout the statement is killed on the
    # server and its reply read and dropped ({#finish_interrupted}), and the
    # session goes back to the pool.
    class Mysql2Connection < Connection
      DEFER = ConnectionPool::DEFER
      ALLOW = ConnectionPool::ALLOW
      private_constant :DEFER, :ALLOW

      class << self
        # @return [Symbol]
        def driver
          :mysql2
        end

        # Connects on NeverBlock's thread pool (libmariadb's connect blocks
        # the thread); only the calling fiber waits. A session that arrives
        # after the caller gave up (timeout, cancellation) is closed.
        #
        # @param config [Hash] Mysql2::Client.new options.
        # @return [Mysql2Connection]
        def open(config)
          # Closed explicitly by the pool; garbage-collected (in a forked
          # child), a client must not end the session the parent still uses.
          config = { automatic_close: false }.merge(whole_seconds(config))
          open_off_loop do
            raw = ::Mysql2::Client.new(config)
            new(raw, raw.thread_id)
          end
        end

        # @return [Array<Module>]
        def errors
          [::Mysql2::Error]
        end

        # @return [Integer, nil]
        def error_code(error)
          error.error_number if error.respond_to?(:error_number)
        end

        private

        TIMEOUTS = %i[connect_timeout read_timeout write_timeout].freeze

        # mysql2 takes whole seconds (Integer(0.5) would be 0: no limit).
        def whole_seconds(config)
          TIMEOUTS.each_with_object(config.dup) do |key, options|
            options[key] = options[key].ceil if options[key].is_a?(Numeric)
          end
        end
      end

      # @param raw [Mysql2::Client]
      # @param thread_id [Integer]
      def initialize(raw, thread_id)
        super
        # For waiting on (and peeking at) mysql2's socket; never closes it.
        @socket = BasicSocket.for_fd(raw.socket)
        @socket.autoclose = false
      end

      # @param sql [String]
      # @param options [Hash] Mysql2::Client#query options (as:, symbolize_keys:, ...).
      # @return [Mysql2::Result, nil] nil for statements without a result set.
      # @raise [Mysql2::Error::TimeoutError] after the client's read_timeout.
      def query(sql, **options)
        Thread.handle_interrupt(DEFER) do
          @raw.query(sql, options.merge(async: true))
          @busy = true
          Thread.handle_interrupt(ALLOW) { wait_for_reply(@raw.read_timeout) }
          begin
            @raw.async_result
          ensure
            @busy = false # the reply was read, or the session is gone
          end
        end
      end

      # @return [Boolean]
      def usable?
        !@raw.closed? && @socket.recv_nonblock(1, Socket::MSG_PEEK, exception: false) == :wait_readable
      rescue IOError, SystemCallError
        false
      end

      # mysql2 does not expose the server status of the last reply, so
      # after the raw connection was lent this asks the server (one round
      # trip): MariaDB's @@in_transaction.
      #
      # @return [Boolean, nil] true inside {Client#transaction}; nil when
      #   the server has no @@in_transaction (MySQL).
      def in_transaction?
        return true if @transaction
        return false unless @lent
        return nil if @no_in_transaction

        query("SELECT @@in_transaction", as: :array).first.first == 1
      rescue ::Mysql2::Error => e
        raise if broken_by?(e)

        @no_in_transaction = true
        nil
      end

      # @return [Boolean]
      def pending_results?
        !@raw.closed? && @raw.more_results?
      end

      # Blocks the loop while it reads (mysql2 reads them with the GVL
      # released); only after a multi-statement query left results unread.
      # @return [void]
      def abandon_results
        @raw.abandon_results!
        nil
      end

      # @return [Boolean]
      def finish_interrupted(deadline)
        return false unless busy? && !@raw.closed? && wait_for_data(deadline)

        begin
          Thread.handle_interrupt(DEFER) { @raw.async_result }
        rescue ::Mysql2::Error => e
          return false if broken_by?(e)
        ensure
          @busy = false
        end
        usable?
      end

      # @return [Boolean]
      def broken_by?(error)
        error.is_a?(::Mysql2::Error::ConnectionError) || @raw.closed?
      end

      # @return [void]
      def close
        @raw.close
      rescue ::Mysql2::Error, IOError, SystemCallError
        nil
      end

      private

      # Waits until the reply has begun to arrive, for at most `seconds`
      # (nil: no limit).
      def wait_for_reply(seconds)
        return if wait_for_data(seconds && Clock.now + seconds)

        raise ::Mysql2::Error::TimeoutError,
              "Timeout waiting for a response from the last query. (waited #{seconds} seconds)"
      end

      # @return [Boolean] false when `deadline` passed first.
      def wait_for_data(deadline)
        loop do
          remaining = deadline && deadline - Clock.now
          return false if remaining && remaining <= 0
          return false unless @socket.wait_readable(remaining)
          # A readiness report can be stale (an epoll registration that
          # outlived its descriptor number: see neverblock/mysql.rb); mysql2's
          # blocking read would then hold the loop until the reply came.
          return true unless @socket.recv_nonblock(1, Socket::MSG_PEEK, exception: false) == :wait_readable
        end
      rescue SystemCallError
        true # a reset connection: mysql2's read reports it
      end
    end
  end
end
