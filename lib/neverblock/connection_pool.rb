# frozen_string_literal: true

require_relative "errors"
require_relative "connection_pool/waiters"
require_relative "connection_pool/lending"
require_relative "connection_pool/taking_back"
require_relative "connection_pool/fork_registry"

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
  #   again, even when a nested `with` raised it; the next checkout opens a
  #   new one.
  # - It is one Mutex, held only for bookkeeping, so the same pool works from
  #   fibers and from plain threads. A fiber of a NeverBlock loop waits in
  #   its scheduler and a checkin hands the connection straight to it
  #   (nothing allocated per wait: the waiters of one loop share a single
  #   expiry timer); a thread, or a fiber under another scheduler, waits on
  #   a condition variable. Both are in connection_pool/waiters.rb.
  # - Interrupts cannot lose a connection: a waiter interrupted after a
  #   connection was handed to it passes it on. On plain threads,
  #   asynchronous interrupts (Thread#raise, Timeout) are held back while the
  #   pool moves a connection between owners. Inside a NeverBlock loop they
  #   need no holding back: Task#cancel, NeverBlock.timeout and Timeout
  #   arrive by Fiber#raise at a wait, which the pool expects at each of its
  #   waits (see {ConnectionPool.masks_needed?}).
  # - With `check_after:`, the `healthy` check is skipped for a connection
  #   that came back less than that many seconds ago (it was just used).
  # - In a forked child each pool forgets the parent's connections, without
  #   closing them, before the child's code runs
  #   (connection_pool/fork_registry.rb).
  #
  # How a connection moves, one verb per direction (the private methods
  # use these and no others):
  #
  # - *lend*: from the pool to a caller, its owner (#lend, #lend_locked,
  #   #lend_to, #lend_for_block, in connection_pool/lending.rb); publicly
  #   {#checkout} and {#with}.
  # - *take back*: from its owner back to the pool (#take_back,
  #   #take_back_from, #take_back_locked, in
  #   connection_pool/taking_back.rb); publicly {#checkin} and {#discard}.
  # - *hand*: a connection taken back, or the right to open one (:open),
  #   straight to the oldest waiter (#hand, in connection_pool/waiters.rb).
  #   One taken back that no one waits for goes to the idle list instead
  #   (#hand_or_idle).
  # - *open* and *close*: a connection is made by the factory, and
  #   discarded (broken, or from before #disconnect_all) by the `close:`
  #   callable; in a forked child the parent's are *forgotten* instead.
  #
  # Calling code must not hold the pool's lock: every public method takes it
  # itself and never calls the connection factory, `close` or the logger
  # holding it. Each private method says whether it is called with the lock
  # held.
  class ConnectionPool
    # The errors that, raised inside {#with}, mark the connection broken.
    BROKEN_ON = [IOError, SystemCallError, Timeout::Error, Cancelled].freeze

    # @api private
    # Masks for Thread.handle_interrupt: hold interrupts back / let them in
    # (also used by the database clients built on the pool).
    DEFER = { Exception => :never }.freeze
    # @api private
    ALLOW = { Exception => :immediate }.freeze

    # One per open connection, reused by each lend: the connection, the
    # #disconnect_all generation and fork epoch it was opened in, when it
    # last came back (monotonic seconds), and while lent, its owner (a fiber,
    # or an object such as a pipeline), how many checkouts deep, and whether
    # it is broken (:unchecked while it still has to pass the health check).
    Hold = Struct.new(:connection, :generation, :epoch, :returned_at, :owner, :depth, :broken)
    private_constant :Hold

    include Lending
    include TakingBack
    include Waiters
    include ForkSafety
    private_constant :Lending, :TakingBack, :Waiters, :ForkSafety

    # @return [Integer] the most connections the pool opens.
    attr_reader :size

    # @return [Numeric] seconds a checkout waits before {PoolTimeout}.
    attr_reader :timeout

    # @return [Integer] bumped each time the pool forgets its connections
    #   in a forked child: a caller that remembers a connection together
    #   with the epoch can tell that it belongs to the parent.
    attr_reader :epoch

    # @param size [Integer] connections at most (>= 1).
    # @param timeout [Numeric] seconds a checkout may wait (>= 0).
    # @param eager [Boolean] open all `size` connections now.
    # @param broken_on [Array<Class>] errors that mark a connection broken
    #   (drivers add theirs, e.g. PG::ConnectionBad). A list that names
    #   Timeout::Error (or an ancestor) also covers a {NeverBlock.timeout}
    #   expiring inside the block.
    # @param close [#call] closes a connection being discarded; default
    #   calls `close` when it responds to it.
    # @param healthy [#call, nil] called with an idle connection before it
    #   is lent again; when it returns false or raises, that connection is
    #   closed and another one taken (e.g. one the server closed while idle).
    # @param forget [#call, nil] called in a forked child with each
    #   connection the child forgets, e.g. to detach its socket so that the
    #   driver's finalizer in the child cannot end the parent's session.
    # @param check_after [Numeric] seconds a connection must have been back
    #   in the pool before `healthy` is called on it (default 0: before every
    #   checkout). A connection that came back moments ago was just used,
    #   and checking it costs each checkout; if it broke since, its next use
    #   fails with a connection-level error and it is replaced.
    # @param name [#to_s, nil] shown in {Server#stats} and logs.
    # @yieldreturn [Object] a new connection.
    # @raise [ArgumentError] without a block, or for a bad size or timeout.
    def initialize(size: 8, timeout: 5, eager: false, broken_on: BROKEN_ON, close: nil, healthy: nil,
                   check_after: 0, forget: nil, name: nil, &factory)
      raise ArgumentError, "ConnectionPool.new needs a block that opens a connection" unless factory

      @name = name&.to_s

      @size = NeverBlock.validate_size!(size, :size)
      @timeout = NeverBlock.validate_timeout!(timeout, :timeout)
      @factory = factory
      @broken_on = broken_on.to_a
      @broken_on += [TimeoutError::Expired] if @broken_on.any? { |error| Timeout::Error <= error }
      @closer = close || ->(connection) { connection.close if connection.respond_to?(:close) }
      @healthy = healthy
      @check_after = NeverBlock.validate_timeout!(check_after, :check_after)
      @forget = forget
      @epoch = 0
      reset
      open_all if eager
    end

    # Lends a connection to the block; returns it afterwards (closing it if
    # the block raised a connection-level error). Re-entrant per fiber.
    #
    # @yieldparam connection [Object]
    # @return [Object] the block's value.
    # @raise [PoolTimeout] when none is free within `timeout` seconds.
    def with
      return lend_for_block { |connection| yield connection } unless ConnectionPool.masks_needed?

      Thread.handle_interrupt(DEFER) do
        lend_for_block { |connection| Thread.handle_interrupt(ALLOW) { yield connection } }
      end
    end

    # Takes a connection for the current fiber until {#checkin}. A fiber
    # that already holds one gets the same one (counted: check it in as
    # many times).
    #
    # @param owner [Object] who holds it: the current fiber, or an object
    #   that outlives any one fiber (a pipeline shared by many), which must
    #   then be passed to {#checkin} too.
    # @return [Object] the connection.
    # @raise [PoolTimeout] when none is free within `timeout` seconds.
    def checkout(owner: Fiber.current)
      return checkout_deferred(owner) unless ConnectionPool.masks_needed?

      Thread.handle_interrupt(DEFER) { checkout_deferred(owner) }
    end

    # Gives back a connection checked out by {#checkout}.
    # @param connection [Object]
    # @param owner [Object] as given to {#checkout}.
    # @return [void]
    # @raise [ArgumentError] if `owner` does not hold it.
    def checkin(connection, owner: Fiber.current)
      return checkin_deferred(connection, owner) unless ConnectionPool.masks_needed?

      Thread.handle_interrupt(DEFER) { checkin_deferred(connection, owner) }
    end

    # @api private
    # {#checkout}, {#checkin} and {#discard} for a caller that has already
    # deferred asynchronous interrupts (`Thread.handle_interrupt(DEFER)`)
    # around the whole checkout-use-checkin when {.masks_needed?}, as the
    # database clients do: each `handle_interrupt` allocates its mask, and
    # this path runs for every query.
    # @return [Object] the connection.
    def checkout_deferred(owner = Fiber.current)
      lend(owner).connection
    end

    # @api private
    # (see #checkout_deferred)
    # @return [void]
    def checkin_deferred(connection, owner = Fiber.current)
      take_back_from(owner, connection, false) unless parents?(connection)
    end

    # @api private
    # (see #checkout_deferred)
    # @return [void]
    def discard_deferred(connection, owner = Fiber.current)
      take_back_from(owner, connection, true) unless parents?(connection)
    end

    # Marks `connection` broken and gives it back: it is closed and a new
    # one is opened when next needed.
    # @param connection [Object]
    # @param owner [Object] as given to {#checkout}.
    # @return [void]
    # @raise [ArgumentError] if `owner` does not hold it.
    def discard(connection, owner: Fiber.current)
      return discard_deferred(connection, owner) unless ConnectionPool.masks_needed?

      Thread.handle_interrupt(DEFER) { discard_deferred(connection, owner) }
    end

    # @api private
    # Whether a checkout-use-checkin must hold asynchronous interrupts back
    # (Thread.handle_interrupt) so that they cannot lose a connection: yes
    # on a plain thread, a blocking fiber, or under a scheduler other than
    # NeverBlock's. No in a fiber of a NeverBlock loop: every interrupt
    # NeverBlock delivers there (Task#cancel, NeverBlock.timeout, Timeout)
    # is a Fiber#raise at one of the fiber's waits, which masks do not hold
    # back, and which the pool and the database clients handle at each of
    # their waits. (Masks would cost an allocation each, and Ruby keeps
    # them per thread, so one held by a suspended fiber also covers the
    # loop's other fibers.)
    # @return [Boolean]
    def self.masks_needed?
      !Fiber.scheduler.is_a?(Scheduler) || Fiber.current.blocking?
    end

    # @api private
    # For a caller that spreads work over the pool's connections (pipelined
    # lanes): whether a checkout now would get a connection without waiting
    # and no one is waiting. Read without the lock: a hint.
    # @return [Boolean]
    def room?
      @waiters.empty? && (!@idle.empty? || @opened < @size)
    end

    # @api private
    # (see #room?)
    # @return [Integer] callers waiting for a connection (without the lock).
    def waiting
      @waiters.size
    end

    # @return [Hash] `{size:, in_use:, idle:, waiting:}`.
    def stats
      detect_fork
      @lock.synchronize { stats_held }
    end

    # Closes the idle connections now and those in use when they come back;
    # later checkouts open new ones.
    # @return [void]
    def disconnect_all
      detect_fork
      idle = @lock.synchronize do
        @generation += 1
        @opened -= @idle.size
        closing = @idle.slice!(0..).map(&:connection)
        closing.each { |connection| @born.delete(connection) }
        Registry.delete(self) if @born.empty?
        closing
      end
      idle.each { |connection| close_quietly(connection) }
    end

    # @return [Integer] checkouts that raised {PoolTimeout} so far (read
    #   without the lock: a count for metrics).
    attr_reader :timeouts

    # @return [Integer] queries cancelled on the server so far (a timeout or
    #   a cancelled task interrupted them), as the database clients count
    #   them with {#query_cancelled}; read without the lock.
    attr_reader :cancels

    # @api private
    # A client cancelled a query running on one of this pool's connections.
    # @return [void]
    def query_cancelled
      @lock.synchronize { @cancels += 1 }
    end

    # @return [String, nil] the name given to {#initialize}, for logs and stats.
    attr_reader :name

    # @return [String]
    def inspect
      "#<#{self.class.name} #{stats.map { |key, value| "#{key}=#{value}" }.join(' ')}>"
    end

    private

    def reset
      @fork_generation = NeverBlock.fork_generation
      @lock = Thread::Mutex.new
      @idle = [] # Holds of connections ready to lend, most recently used last
      @opened = 0 # connections open or being opened
      @holds = {}.compare_by_identity # owner => Hold
      @waiters = [] # Waiters, oldest first
      @spare = [] # Waiters to reuse
      @timeouts = 0 # checkouts that raised PoolTimeout, ever
      @cancels = 0 # queries cancelled on the server (query_cancelled), ever
      @expiry = {}.compare_by_identity # NeverBlock scheduler => its waiters' expiry timer, while armed
      @expire_callback = method(:expire_waiters)
      @generation = 0 # bumped by disconnect_all
      @born = {}.compare_by_identity # connection => its Hold
    end

    # Called with the lock held (or before the pool is shared): records a
    # new connection; a pool with connections is in the Registry.
    # @return [Hold]
    def born(connection)
      Registry.add(self) if @born.empty?
      @born[connection] = Hold.new(connection, @generation, @epoch, nil, nil, 0, false)
    end

    # Called without the lock: opens a connection in a slot already counted
    # in @opened; if that fails, the slot goes to the next waiter.
    # @return [Hold]
    def open_connection
      connection = Thread.handle_interrupt(ALLOW) { @factory.call }
      @lock.synchronize { born(connection) }
    rescue Exception # rubocop:disable Lint/RescueException -- the slot must be given back whatever happened
      @lock.synchronize do
        @opened -= 1
        hand(:open)
      end
      raise
    end

    # Called from #initialize, before the pool is shared.
    def open_all
      opened = []
      @size.times { opened << born(@factory.call) }
      @lock.synchronize do
        @idle.concat(opened)
        @opened = @size
      end
    rescue Exception # rubocop:disable Lint/RescueException -- close what was opened, then fail
      opened.each { |hold| close_quietly(hold.connection) }
      raise
    end

    # Called without the lock. A failing close is logged, not raised: the
    # connection is gone either way. A cancellation or timeout arriving
    # meanwhile still propagates.
    def close_quietly(connection)
      Thread.handle_interrupt(ALLOW) { @closer.call(connection) }
    rescue *INTERRUPTIONS
      raise
    rescue StandardError => e
      NeverBlock.logger.warn("NeverBlock") { "closing a pooled connection failed: #{e.class}: #{e.message}" }
    end

    # Called with the lock held: #stats.
    def stats_held
      { size: @size, in_use: @opened - @idle.size, idle: @idle.size, waiting: @waiters.size }
    end

    def describe(stats)
      stats.map { |key, value| "#{key}: #{value}" }.join(", ")
    end
  end
end
