# frozen_string_literal: true

require_relative "errors"
require_relative "fork_hook"

module NeverBlock
  # A pool of connections (to a database, a cache, an HTTP service) shared by
  # fibers and threads: the 2009 FiberedConnectionPool, with a checkout
  # timeout and broken-connection recovery.
  #
  #   pool = NeverBlock::ConnectionPool.new(size: 8, timeout: 5) { PG.connect(dbname: "app") }
  #   pool.with { |conn| conn.exec("select 1") }
  #
  # - `with` is re-entrant: a nested `with` in the same fiber gets the same
  #   connection back.
  # - Waiters are served first come, first served: a connection checked in
  #   goes straight to the longest waiter. A waiter that gets nothing within
  #   `timeout` seconds raises {PoolTimeout}, whose message has the stats.
  # - A connection whose use raised a connection-level error (by default
  #   IOError, SystemCallError, a timeout or a cancellation, which leave it
  #   mid-conversation; see `broken_on:`) is closed and never handed out
  #   again; the next checkout opens a new one.
  # - It is one Mutex and condition variables, which suspend only the fiber
  #   inside NeverBlock and block the thread elsewhere, so the same pool
  #   works from fibers and from plain threads.
  #
  # Calling code must not hold the pool's lock: every method takes it itself
  # and never calls the connection factory or `close` while holding it.
  class ConnectionPool
    # The errors that, raised inside {#with}, mark the connection broken.
    BROKEN_ON = [IOError, SystemCallError, Timeout::Error, Cancelled].freeze

    # One fiber or thread waiting for a connection.
    Waiter = Struct.new(:condition, :handed)
    private_constant :Waiter

    # @return [Integer] the most connections the pool opens.
    attr_reader :size

    # @return [Numeric] seconds a checkout waits before {PoolTimeout}.
    attr_reader :timeout

    # @param size [Integer] connections at most (>= 1).
    # @param timeout [Numeric] seconds a checkout may wait (>= 0).
    # @param eager [Boolean] open all `size` connections now.
    # @param broken_on [Array<Class>] errors that mark a connection broken
    #   (drivers add theirs, e.g. PG::ConnectionBad).
    # @param close [#call] closes a connection being discarded; default
    #   calls `close` when it responds to it.
    # @yieldreturn [Object] a new connection.
    # @raise [ArgumentError] without a block, or for a bad size or timeout.
    def initialize(size: 8, timeout: 5, eager: false, broken_on: BROKEN_ON, close: nil, &factory)
      raise ArgumentError, "ConnectionPool.new needs a block that opens a connection" unless factory

      @size = NeverBlock.validate_size!(size, :size)
      @timeout = NeverBlock.validate_timeout!(timeout, :timeout)
      @factory = factory
      @broken_on = broken_on
      @closer = close || ->(connection) { connection.close if connection.respond_to?(:close) }
      @lock = Thread::Mutex.new
      @idle = [] # connections ready to hand out, most recently used last
      @opened = 0 # connections open or being opened
      @held = {}.compare_by_identity # fiber => [connection, depth]
      @waiters = [] # Waiters, oldest first
      @retired = {}.compare_by_identity # in use when #disconnect_all ran: closed at checkin
      @generation = NeverBlock.fork_generation
      open_all if eager
    end

    # Lends a connection to the block; returns it afterwards (closing it if
    # the block raised a connection-level error). Re-entrant per fiber.
    #
    # @yieldparam connection [Object]
    # @return [Object] the block's value.
    # @raise [PoolTimeout] when none is free within `timeout` seconds.
    def with
      owner = Fiber.current
      after_fork unless @generation == NeverBlock.fork_generation
      if (held = @held[owner])
        held[1] += 1
        begin
          return yield held[0]
        ensure
          held[1] -= 1
        end
      end

      connection = checkout
      broken = false
      begin
        yield connection
      rescue *@broken_on
        broken = true
        raise
      ensure
        broken ? discard(connection) : checkin(connection)
      end
    end

    # Takes a connection for the current fiber until {#checkin}. A fiber
    # that already holds one gets the same one (counted: check it in as
    # many times).
    #
    # @return [Object] the connection.
    # @raise [PoolTimeout] when none is free within `timeout` seconds.
    def checkout
      owner = Fiber.current
      after_fork unless @generation == NeverBlock.fork_generation
      @lock.synchronize do
        if (held = @held[owner])
          held[1] += 1
          return held[0]
        end
      end
      connection = acquire
      @lock.synchronize { @held[owner] = [connection, 1] }
      connection
    end

    # Gives back the connection the current fiber checked out.
    # @param connection [Object]
    # @return [void]
    # @raise [ArgumentError] if the current fiber does not hold it.
    def checkin(connection)
      release(connection) { |retire| retire ? close_quietly(connection) : hand_over(connection) }
    end

    # Closes `connection` instead of returning it (it is broken), and lets
    # a waiter open a new one.
    # @param connection [Object] held by the current fiber.
    # @return [void]
    def discard(connection)
      release(connection) do
        close_quietly(connection)
        @lock.synchronize do
          @opened -= 1
          grant(:open)
        end
      end
    end

    # @return [Hash] `{size:, in_use:, idle:, waiting:}`.
    def stats
      @lock.synchronize do
        { size: @size, in_use: @opened - @idle.size, idle: @idle.size, waiting: @waiters.size }
      end
    end

    # Closes the idle connections now and those in use when they come back;
    # later checkouts open new ones.
    # @return [void]
    def disconnect_all
      idle = @lock.synchronize do
        @held.each_value { |(connection, _)| @retired[connection] = true }
        @opened -= @idle.size
        @idle.slice!(0..)
      end
      idle.each { |connection| close_quietly(connection) }
    end

    # In a forked child: forgets every connection without closing it (they
    # belong to the parent; closing would end the parent's sessions too).
    # Checkout and #with call it by themselves in a forked child.
    # @return [void]
    def after_fork
      @lock = Thread::Mutex.new
      @idle = []
      @held = {}.compare_by_identity
      @waiters = []
      @retired = {}.compare_by_identity
      @opened = 0
      @generation = NeverBlock.fork_generation
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} #{stats.map { |key, value| "#{key}=#{value}" }.join(' ')}>"
    end

    private

    # A connection for a new checkout: an idle one, a new one while the pool
    # has room, else the next one handed over (FIFO), for up to `timeout`.
    def acquire
      waiter = nil
      action = @lock.synchronize do
        if (connection = @idle.pop)
          next connection
        elsif @opened < @size
          @opened += 1
          next :open
        end

        waiter = Waiter.new(Thread::ConditionVariable.new, nil)
        @waiters << waiter
        wait_for_turn(waiter)
      end
      action == :open ? open_connection : action
    end

    # Called with the lock held.
    def wait_for_turn(waiter)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + @timeout
      until waiter.handed
        remaining = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
        if remaining <= 0
          @waiters.delete(waiter)
          raise PoolTimeout, "no connection free within #{@timeout} s " \
                             "(size: #{@size}, in_use: #{@opened - @idle.size}, idle: #{@idle.size}, " \
                             "waiting: #{@waiters.size}); raise size or timeout, or hold connections for less time"
        end
        waiter.condition.wait(@lock, remaining)
      end
      waiter.handed
    ensure
      # Cancelled or timed out of the wait just as a connection was handed
      # over: pass it on rather than lose it.
      if $! # timed out, cancelled or interrupted: leave the queue
        @waiters.delete(waiter)
        pass_on(waiter) if waiter.handed
      end
    end

    # With the lock held: what was handed to a waiter that left goes on.
    def pass_on(waiter)
      handed = waiter.handed
      waiter.handed = nil
      if handed == :open
        @opened -= 1
        grant(:open)
      else
        give(handed)
      end
    end

    def open_all
      connections = Array.new(@size) { @factory.call }
      @lock.synchronize do
        @idle.concat(connections)
        @opened = @size
      end
    end

    def open_connection
      @factory.call
    rescue Exception # rubocop:disable Lint/RescueException -- the slot must be given back whatever happened
      @lock.synchronize do
        @opened -= 1
        grant(:open)
      end
      raise
    end

    # Ends the current fiber's hold on `connection` and yields whether it was
    # retired by #disconnect_all, when this was the outermost checkout.
    def release(connection)
      owner = Fiber.current
      retire = @lock.synchronize do
        held = @held[owner]
        unless held && held[0].equal?(connection)
          raise ArgumentError, "this fiber did not check out #{connection.inspect} from this pool"
        end

        held[1] -= 1
        next :still_held if held[1].positive?

        @held.delete(owner)
        if @retired.delete(connection)
          @opened -= 1
          grant(:open)
          true
        else
          false
        end
      end
      yield retire unless retire == :still_held
    end

    def hand_over(connection)
      @lock.synchronize { give(connection) }
    end

    # With the lock held: to the oldest waiter, else back to the idle list.
    def give(connection)
      grant(connection) || @idle.push(connection)
    end

    # With the lock held: hands `what` (a connection, or :open for the right
    # to open one) to the oldest waiter. @return [Boolean] whether one took it.
    def grant(what)
      waiter = @waiters.shift or return false
      what == :open && @opened += 1
      waiter.handed = what
      waiter.condition.signal
      true
    end

    def close_quietly(connection)
      @closer.call(connection)
    rescue StandardError => e
      NeverBlock.logger.warn("NeverBlock") { "closing a pooled connection failed: #{e.class}: #{e.message}" }
    end
  end
end
