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
  #   again, even when a nested `with` raised it; the next checkout opens a
  #   new one.
  # - It is one Mutex and condition variables, which suspend only the fiber
  #   inside NeverBlock and block the thread elsewhere, so the same pool
  #   works from fibers and from plain threads. Asynchronous interrupts
  #   (Thread#raise, Timeout on a plain thread) are held back while the pool
  #   moves a connection between owners, so they cannot lose one.
  # - In a forked child each pool forgets the parent's connections, without
  #   closing them, before the child's code runs.
  #
  # Calling code must not hold the pool's lock: every method takes it itself
  # and never calls the connection factory, `close` or the logger holding it.
  class ConnectionPool
    # The errors that, raised inside {#with}, mark the connection broken.
    BROKEN_ON = [IOError, SystemCallError, Timeout::Error, Cancelled].freeze

    # @api private
    # Masks for Thread.handle_interrupt: hold interrupts back / let them in
    # (also used by the database clients built on the pool).
    DEFER = { Exception => :never }.freeze
    # @api private
    ALLOW = { Exception => :immediate }.freeze

    # One fiber or thread waiting for a connection.
    Waiter = Struct.new(:condition, :handed)
    # What an owner (a fiber, or an object such as a pipeline) holds: the
    # connection, how many checkouts deep, and whether a nested `with` found
    # it broken.
    Hold = Struct.new(:owner, :connection, :depth, :broken, :epoch)
    private_constant :Waiter, :Hold

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
    # @param name [#to_s, nil] shown in {Server#stats} and logs.
    # @yieldreturn [Object] a new connection.
    # @raise [ArgumentError] without a block, or for a bad size or timeout.
    def initialize(size: 8, timeout: 5, eager: false, broken_on: BROKEN_ON, close: nil, healthy: nil,
                   forget: nil, name: nil, &factory)
      raise ArgumentError, "ConnectionPool.new needs a block that opens a connection" unless factory

      @name = name&.to_s

      @size = NeverBlock.validate_size!(size, :size)
      @timeout = NeverBlock.validate_timeout!(timeout, :timeout)
      @factory = factory
      @broken_on = broken_on.to_a
      @broken_on += [TimeoutError::Expired] if @broken_on.any? { |error| Timeout::Error <= error }
      @closer = close || ->(connection) { connection.close if connection.respond_to?(:close) }
      @healthy = healthy
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
      Thread.handle_interrupt(DEFER) do
        hold = take
        broken = false
        begin
          Thread.handle_interrupt(ALLOW) { yield hold.connection }
        rescue *@broken_on
          broken = true
          raise
        ensure
          hold.broken ||= broken
          give_back(hold)
        end
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
      Thread.handle_interrupt(DEFER) { checkout_deferred(owner) }
    end

    # Gives back a connection checked out by {#checkout}.
    # @param connection [Object]
    # @param owner [Object] as given to {#checkout}.
    # @return [void]
    # @raise [ArgumentError] if `owner` does not hold it.
    def checkin(connection, owner: Fiber.current)
      Thread.handle_interrupt(DEFER) { checkin_deferred(connection, owner) }
    end

    # @api private
    # {#checkout}, {#checkin} and {#discard} for a caller that has already
    # deferred asynchronous interrupts (`Thread.handle_interrupt(DEFER)`)
    # around the whole checkout-use-checkin, as the database clients do:
    # each `handle_interrupt` allocates its mask, and this path runs for
    # every query.
    # @return [Object] the connection.
    def checkout_deferred(owner = Fiber.current)
      detect_fork
      take(owner).connection
    end

    # @api private
    # (see #checkout_deferred)
    # @return [void]
    def checkin_deferred(connection, owner = Fiber.current)
      give_back(held(connection, owner)) unless parents?(connection)
    end

    # @api private
    # (see #checkout_deferred)
    # @return [void]
    def discard_deferred(connection, owner = Fiber.current)
      return if parents?(connection)

      hold = held(connection, owner)
      hold.broken = true
      give_back(hold)
    end

    # Marks `connection` broken and gives it back: it is closed and a new
    # one is opened when next needed.
    # @param connection [Object]
    # @param owner [Object] as given to {#checkout}.
    # @return [void]
    # @raise [ArgumentError] if `owner` does not hold it.
    def discard(connection, owner: Fiber.current)
      Thread.handle_interrupt(DEFER) { discard_deferred(connection, owner) }
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
        closing = @idle.slice!(0..)
        closing.each { |connection| @born.delete(connection) }
        Registry.delete(self) if @born.empty?
        closing
      end
      idle.each { |connection| close_quietly(connection) }
    end

    # Forgets every connection without closing it: they belong to the parent
    # process, and closing would end the parent's sessions too. Runs by
    # itself in a forked child (forked through Process._fork, see ForkHook)
    # for every pool with open connections, and for any other pool when the
    # child first uses it; checking in a connection the parent held is then
    # a no-op.
    # @return [void]
    def after_fork
      forgotten = @born.keys
      reset
      @epoch += 1
      @forgotten = forgotten.to_h { |connection| [connection, true] }.compare_by_identity
      forgotten.each { |connection| forget_quietly(connection) } if @forget
    end

    # The pools that have open connections, strongly held (a pool with open
    # connections is in use, or its connections leak anyway), so that a
    # forked child can make each forget the parent's connections before the
    # child's own code runs. (Not an ObjectSpace::WeakMap: on Ruby 3.1 its
    # iteration can yield pools that are already garbage.)
    module Registry
      @pools = {}.compare_by_identity
      @lock = Thread::Mutex.new

      class << self
        # @param pool [ConnectionPool]
        def add(pool)
          @lock.synchronize { @pools[pool] = true }
        end

        # @param pool [ConnectionPool]
        def delete(pool)
          @lock.synchronize { @pools.delete(pool) }
        end

        # @return [Array<ConnectionPool>]
        def pools
          @lock.synchronize { @pools.keys }
        end

        # In a forked child (one thread: no lock needed, and the parent's
        # other threads may have held it when they vanished).
        def after_fork
          @lock = Thread::Mutex.new
          @pools.keys.each(&:after_fork)
        end
      end
    end
    private_constant :Registry

    NeverBlock.on_fork_child { Registry.after_fork }

    # The pools of this process that have open connections (what a status
    # page shows; see Server#stats).
    # @return [Array<ConnectionPool>]
    def self.active
      Registry.pools.reject do |pool|
        stats = pool.stats
        (stats[:in_use] + stats[:idle] + stats[:waiting]).zero?
      end
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
      @idle = [] # connections ready to hand out, most recently used last
      @opened = 0 # connections open or being opened
      @holds = {}.compare_by_identity # fiber => Hold
      @waiters = [] # Waiters, oldest first
      @generation = 0 # bumped by disconnect_all
      @born = {}.compare_by_identity # connection => generation it was opened in
    end

    # With the lock held (or before the pool is shared): records a new
    # connection; a pool with connections is in the Registry.
    def born(connection)
      Registry.add(self) if @born.empty?
      @born[connection] = @generation
    end

    def detect_fork
      after_fork if @fork_generation != NeverBlock.fork_generation
    end

    # Whether `connection` is one the parent process held when it forked.
    def parents?(connection)
      detect_fork
      @forgotten&.key?(connection)
    end

    # The current fiber's Hold, one level deeper: an existing one, an idle
    # connection, a new one while the pool has room, or the next one handed
    # over (FIFO) within `timeout`. An idle connection that fails the
    # `healthy` check is closed and the next one tried. Called with
    # interrupts deferred.
    def take(owner = Fiber.current)
      detect_fork
      loop do
        action = @lock.synchronize do
          if (hold = @holds[owner])
            hold.depth += 1
            next hold
          end
          if (connection = @idle.pop)
            next hold_for(owner, connection, :idle)
          end
          if @opened < @size
            @opened += 1
            next :open
          end
          handed = wait_for_turn
          handed == :open ? :open : hold_for(owner, handed, :idle)
        end
        if action == :open
          connection = open_connection
          return @lock.synchronize { hold_for(owner, connection, :new) }
        end
        return action unless action.broken == :idle

        action.broken = false
        return action if !@healthy || checked_healthy?(action)

        action.broken = true
        give_back(action)
      end
    end

    # Runs the health check on a fresh Hold; if the check is interrupted
    # (a timeout, a cancel), the connection is given up and the interrupt
    # raised.
    def checked_healthy?(hold)
      healthy?(hold.connection)
    rescue Exception # rubocop:disable Lint/RescueException -- re-raised
      hold.broken = true
      give_back(hold)
      raise
    end

    # With the lock held. `broken` is :idle while the connection, taken from
    # the idle list or handed over, still has to pass the health check.
    def hold_for(owner, connection, origin)
      @holds[owner] = Hold.new(owner, connection, 1, origin == :idle ? :idle : false, @epoch)
    end

    def healthy?(connection)
      Thread.handle_interrupt(ALLOW) { @healthy.call(connection) }
    rescue Cancelled, Timeout::Error, TimeoutError::Expired
      raise
    rescue StandardError => e
      NeverBlock.logger.debug("NeverBlock") { "pooled connection failed its health check: #{e.class}: #{e.message}" }
      false
    end

    # With the lock held: queues a Waiter and waits for a connection or the
    # right to open one.
    def wait_for_turn
      waiter = Waiter.new(Thread::ConditionVariable.new, nil)
      @waiters << waiter
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + @timeout
      until waiter.handed
        remaining = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
        if remaining <= 0
          @waiters.delete(waiter)
          raise PoolTimeout, "no connection free within #{@timeout} s (#{describe(stats_held)}); " \
                             "raise size or timeout, or hold connections for less time"
        end
        wait(waiter.condition, remaining)
      end
      handed = waiter.handed
      waiter = nil
      handed
    ensure
      # still set: the wait ended by an exception (cancelled, interrupted)
      leave(waiter) if waiter
    end

    # With the lock held: waits on `condition` for up to `seconds`.
    def wait(condition, seconds)
      Thread.handle_interrupt(ALLOW) { condition.wait(@lock, seconds) }
    rescue Exception # rubocop:disable Lint/RescueException -- re-raised
      # Ruby 3.1 does not take the lock back when a fiber's wait is raised
      # into (a cancel, a timeout); the callers' cleanup needs it.
      @lock.lock unless @lock.owned?
      raise
    end

    # With the lock held: a waiter left; what it was handed goes on.
    def leave(waiter)
      @waiters.delete(waiter)
      handed = waiter.handed or return
      if handed == :open
        @opened -= 1
        grant(:open)
      else
        give(handed)
      end
    end

    def open_connection
      connection = Thread.handle_interrupt(ALLOW) { @factory.call }
      @lock.synchronize { born(connection) }
      connection
    rescue Exception # rubocop:disable Lint/RescueException -- the slot must be given back whatever happened
      @lock.synchronize do
        @opened -= 1
        grant(:open)
      end
      raise
    end

    def open_all
      opened = []
      @size.times { opened << open_connection_now }
      @lock.synchronize do
        @idle.concat(opened)
        @opened = @size
      end
    rescue Exception # rubocop:disable Lint/RescueException -- close what was opened, then fail
      opened.each { |connection| close_quietly(connection) }
      raise
    end

    def open_connection_now
      connection = @factory.call
      born(connection)
      connection
    end

    # `owner`'s Hold of `connection`.
    def held(connection, owner = Fiber.current)
      hold = @lock.synchronize { @holds[owner] }
      return hold if hold&.connection.equal?(connection)

      who = owner.equal?(Fiber.current) ? "this fiber" : owner.inspect
      raise ArgumentError, "#{who} did not check out #{connection.inspect} from this pool"
    end

    # One level up; at the outermost level the connection goes to the next
    # waiter or the idle list, or, if broken or from before #disconnect_all,
    # is closed (after the counts are right, so a slow close delays no one).
    def give_back(hold)
      return if hold.epoch != @epoch # held when the process forked: the parent's

      connection = hold.connection
      closing = @lock.synchronize do
        hold.depth -= 1
        next false if hold.depth.positive?

        @holds.delete(hold.owner)
        if hold.broken || @born[connection] != @generation
          @born.delete(connection)
          Registry.delete(self) if @born.empty?
          @opened -= 1
          grant(:open)
          true
        else
          give(connection)
          false
        end
      end
      close_quietly(connection) if closing
    end

    # With the lock held: to the oldest waiter, else back to the idle list.
    def give(connection)
      grant(connection) || @idle.push(connection)
    end

    # With the lock held: hands `what` (a connection, or :open for the right
    # to open one) to the oldest waiter. @return [Boolean] whether one took it.
    def grant(what)
      waiter = @waiters.shift or return false
      @opened += 1 if what == :open
      waiter.handed = what
      waiter.condition.signal
      true
    end

    # Stats, for callers already holding the lock.
    def stats_held
      { size: @size, in_use: @opened - @idle.size, idle: @idle.size, waiting: @waiters.size }
    end

    def describe(stats)
      stats.map { |key, value| "#{key}: #{value}" }.join(", ")
    end

    def forget_quietly(connection)
      @forget.call(connection)
    rescue StandardError => e
      NeverBlock.logger.warn("NeverBlock") { "forgetting a pooled connection after fork failed: #{e.class}: #{e.message}" }
    end

    # A failing close is logged, not raised: the connection is gone either
    # way. A cancellation or timeout arriving meanwhile still propagates.
    def close_quietly(connection)
      Thread.handle_interrupt(ALLOW) { @closer.call(connection) }
    rescue Cancelled, Timeout::Error, TimeoutError::Expired
      raise
    rescue StandardError => e
      NeverBlock.logger.warn("NeverBlock") { "closing a pooled connection failed: #{e.class}: #{e.message}" }
    end
  end
end
