# frozen_string_literal: true

module NeverBlock
  module ActiveRecord
    # SQLite transactions of NeverBlock's fibers take turns, first come first
    # served, one database file at a time, instead of racing for SQLite's
    # write lock.
    #
    # Why: SQLite takes one writer at a time, and the others poll in its busy
    # handler (every millisecond in Rails 8, whose `timeout:` from
    # database.yml, 5000 ms generated, bounds each one's wait; in C holding
    # the whole process in Rails 7.2). Polling is not a queue: a request
    # that begins its transaction just as the lock frees takes it before
    # those that have waited, and under a fiber server, where the request
    # that ends and the one let in next run in the same loop turn, the
    # newcomer nearly always wins. Twenty requests at once that each wrote
    # in a 0.3 s transaction failed three to five with
    # `SQLite3::BusyException: database is locked` after 5 s, even with only
    # five let into the app at once; Puma's three threads served all twenty.
    #
    # How: ActiveRecord's SQLite3 adapter begins a read-write transaction
    # with `begin_db_transaction` (`BEGIN IMMEDIATE` from Rails 8). Called
    # from a non-blocking fiber of a NeverBlock loop, it first takes the
    # database file's turn ({Turn}, one per file and process: handed to its
    # waiters in order, and a fiber waits without holding the loop); commit
    # and rollback hand it on, and so do the ends that lose the transaction
    # (a failed BEGIN, `disconnect!`, `reset!`). A
    # waiting writer waits as long as the writers before it take (as
    # requests wait for one of Puma's threads), within the request's own
    # limits (`request_timeout`, a cancelled request leaves the queue) and
    # at most {WAIT} seconds, after which it raises
    # ActiveRecord::StatementTimeout, the error SQLite's own busy timeout
    # gives (a transaction that waits on another that waits for the turn
    # would otherwise wait forever). A fiber whose other connection holds
    # the file's turn (two pools on one file) does not wait for itself: its
    # BEGIN goes to SQLite as before.
    # Reads, deferred transactions and writes outside a transaction do not
    # take a turn; threads (Puma, Sidekiq, the console) never do, and
    # neither do other processes (Solid Queue's): SQLite's busy handler
    # stays for those.
    #
    # Off with `NEVERBLOCK_SQLITE_WRITE_TURNS=off`; a number there sets
    # {WAIT} (read when a process first begins such a transaction).
    #
    # Prepended to ActiveRecord's SQLite3Adapter when it loads ({ActiveRecord.install}).
    module SqliteWriteTurns
      # The environment variable: `off`, or the seconds of {WAIT}.
      SWITCH = "NEVERBLOCK_SQLITE_WRITE_TURNS"

      # Seconds a transaction waits for its turn at most, by default.
      WAIT = 60

      # A database file's turn in this process. Handed over, not put back:
      # a transaction that ends gives the turn to the one that has waited
      # longest, so that one that begins meanwhile (the same request's next
      # `save`) queues behind it; a waiter that is cancelled or times out
      # after the turn was handed to it passes it on.
      class Turn
        # @return [Fiber, nil] the fiber whose transaction has the turn.
        attr_reader :holder

        def initialize
          @lock = Thread::Mutex.new
          @holder = nil
          @waiters = [] # [Thread::Queue, Fiber], longest waiting first
        end

        # Takes the turn for the calling fiber, waiting at most `seconds`.
        # @param seconds [Numeric]
        # @return [Boolean] false when the wait timed out.
        def take(seconds)
          mailbox = nil
          @lock.synchronize do
            if @holder.nil?
              @holder = Fiber.current
              return true
            end
            mailbox = Thread::Queue.new
            @waiters << [mailbox, Fiber.current]
          end
          begin
            NeverBlock.timeout(seconds) { mailbox.pop }
            true
          rescue NeverBlock::TimeoutError # this wait's own (an enclosing timeout's expiry is not one)
            give_back unless still_waiting?(mailbox) # handed the turn as the timer fired
            false
          rescue Exception # rubocop:disable Lint/RescueException -- cancelled: the turn must not be lost
            give_back unless still_waiting?(mailbox)
            raise
          end
        end

        # Gives the turn to the longest waiting, or frees it.
        # @return [void]
        def give_back
          mailbox = nil
          @lock.synchronize do
            mailbox, @holder = @waiters.shift
          end
          mailbox&.push(true)
          nil
        end

        # @return [Integer] transactions waiting for the turn.
        def waiting
          @lock.synchronize { @waiters.size }
        end

        private

        # Whether `mailbox`'s waiter is still in line; takes it out if so.
        def still_waiting?(mailbox)
          @lock.synchronize do
            index = @waiters.index { |(waiting, _fiber)| waiting.equal?(mailbox) }
            index ? (@waiters.delete_at(index) && true) : false
          end
        end
      end

      @turns = {}
      @turns_pid = Process.pid
      @lock = Thread::Mutex.new

      class << self
        # @return [Numeric, nil] seconds a transaction waits for its turn
        #   at most; nil when transactions take no turns (see {SWITCH}).
        # @raise [ArgumentError] for a SWITCH that is neither `off` nor a
        #   positive number of seconds.
        def wait
          return @wait if defined?(@wait)

          value = ENV[SWITCH].to_s.strip
          @wait = if value.empty? then WAIT
                  elsif value.casecmp?("off") then nil
                  else
                    seconds = Float(value, exception: false)
                    unless seconds&.positive? && seconds.finite?
                      raise ArgumentError, "#{SWITCH} must be off or a number of seconds > 0; got #{value.inspect}"
                    end

                    seconds
                  end
        end

        # @api private
        # The turn of the database file at `path` in this process.
        # @param path [String]
        # @return [Turn]
        def turn_for(path)
          @lock.synchronize do
            unless @turns_pid == Process.pid # a fork: the parent's holders are not here
              @turns = {}
              @turns_pid = Process.pid
            end
            @turns[path] ||= Turn.new.tap { announce(path) }
          end
        end

        private

        # One line when a process first has a file's transactions take turns.
        def announce(path)
          NeverBlock.logger.info do
            "NeverBlock: SQLite transactions on #{path} take turns in this process, first come first served " \
              "(#{SWITCH}=off turns that off); a SQLite query holds the event loop while it runs, so requests that " \
              "wait on SQLite wait for each other (docs/rails.md, SQLite)"
          end
        end
      end

      # ActiveRecord's `begin_db_transaction`: takes the file's turn first
      # (see the module comment).
      # @return [void]
      def begin_db_transaction
        take_write_turn
        super
      rescue Exception # rubocop:disable Lint/RescueException -- a cancelled BEGIN gives the turn back too
        give_back_write_turn
        raise
      end

      # @return [void]
      def commit_db_transaction
        super
      ensure
        give_back_write_turn
      end

      # @return [void]
      def exec_rollback_db_transaction
        super
      ensure
        give_back_write_turn
      end

      # @return [void]
      def disconnect!
        super
      ensure
        give_back_write_turn
      end

      # @return [void]
      def reset!
        super
      ensure
        give_back_write_turn
      end

      private

      def take_write_turn
        return if @neverblock_write_turn || !NeverBlock.neverblocking?

        wait = SqliteWriteTurns.wait or return
        path = neverblock_database_path or return
        turn = SqliteWriteTurns.turn_for(path)
        return if turn.holder.equal?(Fiber.current) # its other connection's transaction

        unless turn.take(wait)
          raise ::ActiveRecord::StatementTimeout, "waited #{wait} s for the turn to write to #{path}: the " \
                                                  "transactions before it held it that long " \
                                                  "(NeverBlock::ActiveRecord::SqliteWriteTurns)"
        end
        @neverblock_write_turn = turn
      end

      def give_back_write_turn
        turn = @neverblock_write_turn or return

        @neverblock_write_turn = nil
        turn.give_back
      end

      # The database file, absolute; nil for an in-memory database (private
      # to its connection, so it has no one to take turns with).
      def neverblock_database_path
        database = @config[:database].to_s
        return nil if database.empty? || database == ":memory:" || database.include?("mode=memory")

        File.expand_path(database.delete_prefix("file:").split("?", 2).first)
      end
    end
  end
end
