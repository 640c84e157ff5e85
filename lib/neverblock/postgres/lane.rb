# frozen_string_literal: true

module NeverBlock
  module Postgres
    # One pooled connection in libpq pipeline mode, shared by the fibers of
    # one thread: each statement is sent at once, followed by its own sync
    # point (so an error fails only that statement), and a reader fiber takes
    # the results off the socket in order and hands each to the fiber that
    # sent the statement. While the lane has statements in flight it holds
    # its connection; when the last result is handed out and the fibers
    # that got the last results have had their turn without sending
    # another, it leaves pipeline mode and returns the connection to the
    # pool.
    #
    # Statements from different fibers never interleave: with libpq >= 17
    # sending only buffers a statement and its sync point (nothing yields in
    # between); with older libpq a lock covers the pair.
    # The first sender of a burst lets the other ready fibers queue theirs
    # (it passes its turn) and then flushes them all in one write. A lane is
    # used by one thread only.
    #
    # On NeverBlock's loop a sender waits for its result in the scheduler
    # itself (Scheduler#suspend, woken by the reader with Scheduler#wake);
    # under another scheduler, on a Thread::Queue. This runs per statement:
    # the scheduler's own wait takes no queue, no block and unblock hooks.
    class Lane
      # One statement: what to send, and where its result goes. A fiber of
      # a NeverBlock loop waits in its scheduler (`to` is the scheduler,
      # `waiter` the fiber, `outcome` PENDING until answered); under any
      # other scheduler it waits on a Thread::Queue (`to`).
      Request = Struct.new(:sql, :params, :result_format, :to, :waiter, :outcome, :abandoned)

      # libpq >= 17 can queue a sync point without flushing it.
      QUEUED_SYNC = PG::Connection.method_defined?(:send_pipeline_sync)
      # Whether pg lets the lane turn off its flush after every send (a
      # private setter of pg >= 1.3; without it each statement is one write).
      BATCHED = QUEUED_SYNC && PG::Connection.private_method_defined?(:flush_data=)
      # Server errors that end the backend (FATAL): the statement that gets
      # one may or may not have committed, and nothing after it is answered.
      CONNECTION_ENDING = [PG::AdminShutdown, PG::CrashShutdown, PG::CannotConnectNow].freeze
      NO_PARAMS = [].freeze
      # A request's outcome until its result (or error) comes.
      PENDING = Object.new.freeze
      # Raised in the reader at its wait when the lane failed in another
      # fiber (see #stop_reader); #read rescues it.
      ReaderStopped = Class.new(StandardError)
      private_constant :QUEUED_SYNC, :BATCHED, :CONNECTION_ENDING, :NO_PARAMS, :PENDING, :ReaderStopped

      # @param pool [ConnectionPool]
      # @param on_release [#call] called with the lane when it stops taking
      #   statements (drained or failed).
      def initialize(pool, on_release)
        @pool = pool
        @on_release = on_release
        @pending = []
        @reading = false
        @reader = nil
        @open = true
        @conn = pool.checkout(owner: self)
        begin
          @conn.enter_pipeline_mode
          # pg flushes after every send on its nonblocking connections; the
          # lane flushes bursts itself (see #flush_burst). Restored in #release.
          @conn.send(:flush_data=, false) if BATCHED
        rescue Exception # rubocop:disable Lint/RescueException -- the connection must go back
          @pool.discard(@conn, owner: self)
          raise
        end
      end

      # @return [Integer] statements sent and not yet answered.
      def load
        @pending.size
      end

      # @return [Boolean] whether it still takes statements.
      def open?
        @open
      end

      # Stops taking statements; the connection goes back to the pool when
      # the ones in flight are answered.
      # @return [void]
      def close
        return unless @open

        @open = false
        @on_release.call(self)
        release unless @reading
      end

      # Sends a statement and waits for its result. If the wait is
      # interrupted (a timeout, a cancel) the statement is abandoned: its
      # result is dropped, and once it is the one running, PostgreSQL is asked
      # to cancel it (see #read).
      #
      # @param sql [String] one statement.
      # @param params [Array, nil]
      # @param result_format [Integer] 0 text, 1 binary.
      # @return [PG::Result]
      # @raise [PG::Error] the statement's error; the connection's when it
      #   could not be sent; {OutcomeUnknown} when the connection was lost
      #   after it was sent.
      def exec(sql, params, result_format)
        scheduler = Fiber.scheduler
        request = if scheduler.is_a?(Scheduler)
                    Request.new(sql, params || NO_PARAMS, result_format, scheduler, Fiber.current, PENDING, false)
                  else
                    Request.new(sql, params || NO_PARAMS, result_format, Thread::Queue.new, nil, PENDING, false)
                  end
        enqueue(request)
        begin
          begin
            BATCHED ? flush_burst(scheduler) : flush
          rescue PG::Error, IOError, SystemCallError
            nil # #fail gave every statement in flight, this one too, its OutcomeUnknown
          end
          outcome = wait_for(request)
        rescue Exception # rubocop:disable Lint/RescueException -- re-raised
          abandon(request)
          raise
        end
        return outcome unless outcome.is_a?(Exception)

        error = outcome.exception(outcome.message)
        error.set_backtrace(caller)
        raise error
      end

      # @return [String]
      def inspect
        "#<#{self.class.name} pending=#{@pending.size}#{' closing' unless @open}>"
      end

      private

      # Queues the statement and its sync point in libpq's buffer (no IO
      # when BATCHED; otherwise pg flushes each and may wait, so a lock keeps
      # other fibers' statements from slipping in between).
      def enqueue(request)
        if BATCHED
          send_statement(request)
        else
          (@send_lock ||= Thread::Mutex.new).synchronize { send_statement(request) }
        end
        start_reader unless @reading
      rescue PG::Error, IOError, SystemCallError => e
        fail(e)
        raise
      end

      def send_statement(request)
        @conn.send_query_params(request.sql, request.params, request.result_format)
        QUEUED_SYNC ? @conn.send_pipeline_sync : @conn.sync_pipeline_sync
        @pending << request
      end

      # A lane whose reader cannot start (no fiber to be had) fails at once,
      # rather than leaving its statements waiting for no one.
      def start_reader
        @reading = true
        Fiber.schedule { read }
      rescue Exception => e # rubocop:disable Lint/RescueException -- re-raised
        @reading = false
        fail(e)
        raise
      end

      def flush
        @conn.flush
      rescue PG::Error, IOError, SystemCallError => e
        fail(e)
        raise
      end

      # One flush for every statement queued by the fibers ready now: the
      # first sender passes its turn (the loop runs the others, which find
      # the flush scheduled and only queue), then writes them all. On
      # NeverBlock's loop it waits in the selector's ready queue
      # (Scheduler#yield), which the loop runs once this turn's ready fibers
      # have: no timer, as `sleep 0` makes.
      def flush_burst(scheduler)
        return if @flush_scheduled

        @flush_scheduled = true
        begin
          pass_turn(scheduler)
        ensure
          @flush_scheduled = false
          flush
        end
      end

      # The statement's outcome, once the reader has it. A wake-up without
      # one (Scheduler#suspend may return for nothing) waits again.
      def wait_for(request)
        to = request.to
        return to.pop unless to.is_a?(Scheduler)

        to.suspend while PENDING.equal?(request.outcome)
        request.outcome
      end

      # Hands a statement its outcome: into its queue, or wakes its fiber,
      # unless that fiber has given up on it (it waits for something else
      # now, which a wake-up would cut short).
      def answer(request, outcome)
        to = request.to
        return to.push(outcome) unless to.is_a?(Scheduler)

        request.outcome = outcome
        to.wake(request.waiter) unless request.abandoned
      end

      def abandon(request)
        request.abandoned = true
        cancel_running if @pending.first.equal?(request) && !@cancel_fence
      end

      # Asks PostgreSQL to cancel the statement running now, which should be
      # the abandoned one at the head of the pipeline, but may be one sent
      # after it if that finished meanwhile. When pg's cancel returns, the
      # server has signalled the backend, so the statement hit is one of
      # those sent by then: up to the fence, a "query canceled" error is
      # ours, and a statement that got it without being abandoned is sent
      # again (it had no effect: each statement is its own transaction).
      #
      # While the cancel request is on its way (pg sends it without blocking
      # the loop), any "query canceled" the reader sees is ours too, and the
      # connection is not given back: the cancel must not reach its next
      # owner.
      def cancel_running
        @cancelling = true
        @conn.cancel # returns an error message rather than raising
        @pool.query_cancelled
        @cancel_fence = @pending.last
      ensure
        @cancelling = false
        release if !@open && !@reading
      end

      # The reader fiber: results in order until nothing is in flight. It is
      # @reader while it runs: its Task on NeverBlock's loop, its Fiber
      # under another scheduler (see #stop_reader).
      def read
        @reading = true
        @reader = Fiber.scheduler.is_a?(Scheduler) ? Task.current : Fiber.current
        while true # rubocop:disable Style/InfiniteLoop
          until @pending.empty?
            request = @pending.first
            cancel_running if request.abandoned && !@cancel_fence
            outcome = read_one
            @pending.shift
            ours = (@cancelling || @cancel_fence) && outcome.is_a?(PG::QueryCanceled)
            @cancel_fence = nil if ours || @cancel_fence.equal?(request)
            if ours && !request.abandoned
              enqueue(request)
              @conn.flush
            else
              answer(request, outcome)
            end
          end
          break unless more_coming?
        end
      rescue Exception => e # rubocop:disable Lint/RescueException -- delivered to every waiter
        fail(e)
      ensure
        @reader = nil
        @reading = false
        close if @pending.empty?
        release unless @open
      end

      # Every statement sent has been answered. The fibers just answered
      # often send their next one as soon as they run: the reader lets them
      # run first (it passes its turn behind them), and goes on reading if
      # they did. Closing at once would hand the connection back and open a
      # new lane for that next burst (a checkout, pipeline mode on and off,
      # a reader fiber): with 100 fibers over a pool of 12, a new lane every
      # 18 statements.
      def more_coming?
        return false unless @open

        pass_turn(Fiber.scheduler)
        !@pending.empty?
      end

      # Lets the other ready fibers run first: on NeverBlock's loop from the
      # ready queue (Scheduler#yield, no timer), elsewhere with `sleep 0`.
      def pass_turn(scheduler)
        scheduler.is_a?(Scheduler) ? scheduler.yield : sleep(0)
      end

      # One statement's result (or its error), then its sync point.
      def read_one
        result = nil
        while (next_result = @conn.get_result)
          result&.clear
          result = next_result
        end
        sync = @conn.get_result
        unless sync&.result_status == PG::PGRES_PIPELINE_SYNC
          raise PG::ConnectionBad, "pipeline out of step: expected a sync point, got #{sync&.res_status || 'nothing'}"
        end
        # Freed now rather than by the garbage collector: pg counts each
        # result's libpq memory towards the next GC, so a sync point left
        # to it made GC run (and sweep) about twice as often per statement.
        sync.clear

        begin
          result.check
        rescue PG::ServerError => e
          result.clear
          raise e if CONNECTION_ENDING.any? { |kind| e.is_a?(kind) } # the backend is going: fails the lane

          return e
        end
        result
      end

      # The connection is unusable: every statement in flight gets
      # {OutcomeUnknown}, with what broke it as its cause, and a reader
      # still waiting is stopped (from a sender: #stop_reader).
      def fail(error)
        @failed = true
        pending = @pending.slice!(0..)
        unless pending.empty?
          unknown = outcome_unknown(error)
          pending.each { |request| answer(request, unknown) }
        end
        close
        stop_reader
      end

      # Interrupts the reader at its wait when the lane failed in another
      # fiber (a sender's #enqueue or #flush); its #read then ends, and
      # gives the connection back.
      #
      # Why it must be told: libpq closes a connection's socket as soon as
      # any call on it reads the end of the connection, and a sender's
      # calls read too (a write that fails makes libpq read what the server
      # said; after an error, until its sync point, libpq writes each
      # statement as it is queued). The reader may be waiting on that same
      # socket in the selector meanwhile, and epoll drops a closed
      # descriptor without waking its waiter: the reader would wait forever,
      # the lane would keep its connection, and the loop would never end.
      # It has nothing left to read: every statement in flight has its
      # outcome.
      #
      # On NeverBlock's loop through Scheduler#interrupt (delivered at the
      # reader's wait, only while its task still runs); under another
      # scheduler through its `raise(fiber, exception)` if it has one
      # (async's); without one, the reader ends when its wait does.
      def stop_reader
        reader = @reader or return
        stop = ReaderStopped.new("the lane's connection was lost in another fiber")
        if reader.is_a?(Task)
          reader.scheduler.interrupt(reader, stop) unless reader.fiber.equal?(Fiber.current)
        elsif !reader.equal?(Fiber.current) && (scheduler = Fiber.scheduler).respond_to?(:raise)
          scheduler.raise(reader, stop)
        end
      end

      def outcome_unknown(error)
        raise OutcomeUnknown, "the connection was lost with this statement in flight, so whether it ran is " \
                              "unknown (#{error.class}: #{error.message.strip})"
      rescue OutcomeUnknown => e
        e # raised inside the rescue of `error`, so its cause is set
      end

      def release
        return if @released || @reading || @cancelling

        @released = true
        @conn.send(:flush_data=, true) if BATCHED
        if !@failed && @conn.pipeline_status == PG::PQ_PIPELINE_ON && @conn.exit_pipeline_mode.nil?
          @pool.checkin(@conn, owner: self)
        else
          @pool.discard(@conn, owner: self)
        end
      rescue PG::Error
        @pool.discard(@conn, owner: self)
      end
    end
  end
end
