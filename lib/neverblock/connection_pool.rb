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
  # - It is one Mutex, held only for bookkeeping, so the same pool works from
  #   fibers and from plain threads. A fiber of a NeverBlock loop waits in
  #   its scheduler and a checkin hands the connection straight to it
  #   (nothing allocated per wait: the waiters of one loop share a single
  #   expiry timer, see #wait_in_loop); a thread, or a fiber under another
  #   scheduler, waits on a condition variable.
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

    # One fiber or thread waiting for a connection: `handed` is set, with the
    # lock held, to the Hold handed over or to :open (the right to open one).
    # A fiber in a NeverBlock loop is woken through its `scheduler`, and
    # gives up at `deadline` (monotonic seconds) once its loop's expiry
    # timer has set `expired`; anything else waits on `condition`. Records
    # are reused (see #wait_for_turn); identity is equality, so Array#delete
    # finds the right one.
    class Waiter
      attr_accessor :fiber, :scheduler, :condition, :handed, :deadline, :expired
    end

    # One per open connection, reused by each checkout: the connection, the
    # #disconnect_all generation and fork epoch it was opened in, when it
    # last came back (monotonic seconds), and while lent, its owner (a fiber,
    # or an object such as a pipeline), how many checkouts deep, and whether
    # it is broken (:unchecked while it still has to pass the health check).
    Hold = Struct.new(:connection, :generation, :epoch, :returned_at, :owner, :depth, :broken)
    # Waiter records kept for reuse at most.
    SPARE_WAITERS = 128
    # Seconds before an expiry timer that found the lock taken tries again.
    EXPIRY_RETRY = 0.001
    private_constant :Waiter, :Hold, :SPARE_WAITERS, :EXPIRY_RETRY

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
      return lend { |connection| yield connection } unless ConnectionPool.masks_needed?

      Thread.handle_interrupt(DEFER) do
        lend { |connection| Thread.handle_interrupt(ALLOW) { yield connection } }
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
      take(owner).connection
    end

    # @api private
    # (see #checkout_deferred)
    # @return [void]
    def checkin_deferred(connection, owner = Fiber.current)
      release(connection, owner, false) unless parents?(connection)
    end

    # @api private
    # (see #checkout_deferred)
    # @return [void]
    def discard_deferred(connection, owner = Fiber.current)
      release(connection, owner, true) unless parents?(connection)
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
      @idle = [] # Holds of connections ready to lend, most recently used last
      @opened = 0 # connections open or being opened
      @holds = {}.compare_by_identity # owner => Hold
      @waiters = [] # Waiters, oldest first
      @spare = [] # Waiters to reuse
      @expiry = {}.compare_by_identity # NeverBlock scheduler => its waiters' expiry timer, while armed
      @expire_callback = method(:expire_waiters)
      @generation = 0 # bumped by disconnect_all
      @born = {}.compare_by_identity # connection => its Hold
    end

    # With the lock held (or before the pool is shared): records a new
    # connection; a pool with connections is in the Registry.
    # @return [Hold]
    def born(connection)
      Registry.add(self) if @born.empty?
      @born[connection] = Hold.new(connection, @generation, @epoch, nil, nil, 0, false)
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
    # over (FIFO) within `timeout`. An idle or handed-over connection that
    # fails the `healthy` check is closed and the next one tried. Called
    # with interrupts deferred when {.masks_needed?}.
    def take(owner = Fiber.current)
      detect_fork
      # (`while`, not `loop`: returning from a block allocates.)
      while true # rubocop:disable Style/InfiniteLoop
        hold = @lock.synchronize { reserve(owner) }
        if hold.equal?(:open)
          hold = open_connection
          return @lock.synchronize { lend_to(owner, hold, false) }
        end
        return hold unless hold.broken.equal?(:unchecked)

        hold.broken = false
        return hold if checked_healthy?(hold)

        hold.broken = true
        give_back(hold)
      end
    end

    # With the lock held: `owner`'s Hold one level deeper, an idle one, one
    # handed over after a wait, or :open when a connection may be opened.
    def reserve(owner)
      if (hold = @holds[owner])
        hold.depth += 1
        return hold
      end
      if (hold = @idle.pop)
        return lend_to(owner, hold, true)
      end
      if @opened < @size
        @opened += 1
        return :open
      end
      handed = wait_for_turn
      handed.equal?(:open) ? handed : lend_to(owner, handed, true)
    end

    # With the lock held: lends `hold` to `owner`. A `reused` connection
    # (idle, or handed over) is marked :unchecked when the health check is
    # due.
    def lend_to(owner, hold, reused)
      hold.owner = owner
      hold.depth = 1
      hold.broken = reused && @healthy && due_for_check?(hold) ? :unchecked : false
      @holds[owner] = hold
    end

    def due_for_check?(hold)
      @check_after.zero? || Clock.now - hold.returned_at >= @check_after
    end

    # Checkout, the block, checkin: the body of #with.
    def lend
      hold = take
      broken = false
      begin
        yield hold.connection
      rescue *@broken_on
        broken = true
        raise
      ensure
        hold.broken ||= broken
        give_back(hold)
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

    def healthy?(connection)
      return @healthy.call(connection) unless ConnectionPool.masks_needed?

      Thread.handle_interrupt(ALLOW) { @healthy.call(connection) }
    rescue Cancelled, Timeout::Error, TimeoutError::Expired
      raise
    rescue StandardError => e
      NeverBlock.logger.debug("NeverBlock") { "pooled connection failed its health check: #{e.class}: #{e.message}" }
      false
    end

    # With the lock held, also on every way out: queues a Waiter (a reused
    # record) and waits for a Hold handed over or the right to open a
    # connection (:open). A waiter that is interrupted passes on what it was
    # handed meanwhile.
    # @raise [PoolTimeout] when nothing came within `timeout` seconds.
    def wait_for_turn
      waiter = @spare.pop || Waiter.new
      @waiters << waiter
      begin
        ConnectionPool.masks_needed? ? wait_on_condition(waiter) : wait_in_loop(waiter)
      rescue Exception # rubocop:disable Lint/RescueException -- re-raised
        leave(waiter)
        raise
      end
      handed = waiter.handed
      unless handed
        @waiters.delete(waiter)
        recycle(waiter)
        raise PoolTimeout, "no connection free within #{@timeout} s (#{describe(stats_held)}); " \
                           "raise size or timeout, or hold connections for less time"
      end
      recycle(waiter)
      handed
    end

    # With the lock held on entry and on every way out: suspends this fiber
    # in its NeverBlock scheduler, without the lock (other threads may check
    # in meanwhile), until a checkin hands it something and wakes it
    # (Scheduler#unblock, from any thread) or its deadline passes.
    #
    # No timer per wait: every waiter has the pool's one `timeout` and joins
    # the queue at the back, so deadlines grow along @waiters, and the
    # oldest waiter of a loop is the first of that loop to expire. Each loop
    # with waiters has one timer (#arm_expiry), due at its oldest waiter's
    # deadline; when it fires it expires the waiters that are due and
    # re-arms for the next one. Under steady contention it fires about once
    # per `timeout`, however many checkouts wait meanwhile.
    def wait_in_loop(waiter)
      scheduler = Fiber.scheduler
      waiter.fiber = Fiber.current
      waiter.scheduler = scheduler
      return if @timeout.zero? # no wait at all: PoolTimeout now, as on a thread

      waiter.deadline = Clock.now + @timeout
      arm_expiry(scheduler, waiter.deadline) unless @expiry.key?(scheduler)
      @lock.unlock
      begin
        # A wake-up without cause (#unblock is allowed to be spurious) waits again.
        scheduler.block(waiter, nil) until waiter.handed || waiter.expired
      ensure
        relock
      end
    end

    # With the lock held: arms `scheduler`'s expiry timer for `deadline`.
    # Forgets the timers of closed schedulers, whose loops will never fire them.
    def arm_expiry(scheduler, deadline)
      @expiry.delete_if { |other, _| other.closed? } unless @expiry.empty?
      @expiry[scheduler] = scheduler.add_timer(deadline - Clock.now, @expire_callback, scheduler)
    end

    # `scheduler`'s expiry timer fired (on its loop): wakes its waiters whose
    # deadline has passed, without a connection, and re-arms for the next.
    #
    # The loop's own fiber must not wait for the lock: a fiber of this loop
    # may hold it while it waits for another lock (the Registry's, held by
    # another thread), and only the loop can resume that fiber. When the
    # lock is taken it tries again in EXPIRY_RETRY seconds (its @expiry
    # entry stays, so that no waiter arms a second timer meanwhile).
    def expire_waiters(scheduler)
      return scheduler.add_timer(EXPIRY_RETRY, @expire_callback, scheduler) unless @lock.try_lock

      begin
        @expiry.delete(scheduler)
        now = Clock.now
        @waiters.each do |waiter|
          next unless waiter.scheduler.equal?(scheduler)

          if waiter.deadline > now
            arm_expiry(scheduler, waiter.deadline)
            break
          end
          waiter.expired = true
          scheduler.unblock(waiter, waiter.fiber)
        end
      ensure
        @lock.unlock
      end
    end

    # Takes the lock back after #wait_in_loop. Another thread may hold it,
    # so this may wait too, and a cancel or timeout may arrive meanwhile
    # (Mutex#lock then returns without the lock): the lock is taken anyway
    # and the interrupt raised once it is held, so that the caller's cleanup
    # runs with it.
    def relock
      interrupt = lock_despite_interrupts
      raise interrupt if interrupt
    end

    # Takes the lock even when an interrupt (a cancel, a timeout) arrives
    # while it waits for it (Mutex#lock then returns without the lock).
    # @return [Exception, nil] the interrupt, for the caller to raise once
    #   its work under the lock is done.
    def lock_despite_interrupts
      interrupt = nil
      begin
        @lock.lock
      rescue Exception => e # rubocop:disable Lint/RescueException -- returned for the caller to raise
        interrupt ||= e
        retry unless @lock.owned?
      end
      interrupt
    end

    # With the lock held (Mutex#sleep gives it up meanwhile): waits on the
    # waiter's condition variable until handed something or `timeout`
    # seconds pass.
    def wait_on_condition(waiter)
      condition = (waiter.condition ||= Thread::ConditionVariable.new)
      deadline = Clock.now + @timeout
      until waiter.handed
        remaining = deadline - Clock.now
        break unless remaining.positive?

        wait(condition, remaining)
      end
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

    # With the lock held: an interrupted waiter leaves the queue; what it
    # was handed meanwhile goes on.
    def leave(waiter)
      handed = waiter.handed
      if handed.nil?
        @waiters.delete(waiter)
      elsif handed.equal?(:open)
        @opened -= 1
        grant(:open)
      else
        give(handed)
      end
      recycle(waiter)
    end

    # With the lock held: keeps a Waiter no longer queued for the next wait.
    def recycle(waiter)
      waiter.handed = waiter.fiber = waiter.scheduler = waiter.expired = nil
      @spare << waiter if @spare.size < SPARE_WAITERS
    end

    # Opens a connection in a slot already counted in @opened.
    # @return [Hold]
    def open_connection
      connection = Thread.handle_interrupt(ALLOW) { @factory.call }
      @lock.synchronize { born(connection) }
    rescue Exception # rubocop:disable Lint/RescueException -- the slot must be given back whatever happened
      @lock.synchronize do
        @opened -= 1
        grant(:open)
      end
      raise
    end

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

    # {#checkin} or {#discard} (`broken`) of `owner`'s Hold of `connection`,
    # in one turn of the lock.
    def release(connection, owner, broken)
      held = true
      put_back_and_settle(connection) do
        hold = @holds[owner]
        next held = false unless hold&.connection.equal?(connection)

        hold.broken = true if broken
        put_back(hold)
      end
      return if held

      who = owner.equal?(Fiber.current) ? "this fiber" : owner.inspect
      raise ArgumentError, "#{who} did not check out #{connection.inspect} from this pool"
    end

    # One level up (see #put_back); closes the connection if it goes.
    def give_back(hold)
      return if hold.epoch != @epoch # held when the process forked: the parent's

      put_back_and_settle(hold.connection) { put_back(hold) }
    end

    # Runs the block (a #put_back) with the lock held, then #settle's its
    # outcome. When another thread holds the lock a fiber waits for it, and
    # an interrupt arriving then (a timeout, a cancel) must not skip the
    # block, or the connection would never come back: the lock is taken
    # anyway, the connection goes back, and the interrupt is raised after.
    def put_back_and_settle(connection)
      interrupt = lock_despite_interrupts
      begin
        outcome = yield
      ensure
        @lock.unlock
      end
      settle(outcome, connection)
      raise interrupt if interrupt
    end

    # What #put_back left to do once the lock is let go: close the
    # connection (true), or run the waiter it was handed to (a Waiter).
    def settle(outcome, connection)
      if outcome.equal?(true)
        close_quietly(connection)
      elsif outcome
        outcome.scheduler.hand_over(outcome.fiber)
      end
    end

    # With the lock held: one level up; at the outermost level the
    # connection goes to the next waiter or the idle list, or, if broken or
    # from before #disconnect_all, is to be closed (by the caller, after the
    # counts are right, so that a slow close delays no one).
    # @return [Boolean, Waiter] true when the caller must close it; a
    #   Waiter of the caller's own loop that it went to, for the caller to
    #   run (see #grant).
    def put_back(hold)
      hold.depth -= 1
      return false if hold.depth.positive?

      @holds.delete(hold.owner)
      hold.owner = nil
      if hold.broken || hold.generation != @generation
        @born.delete(hold.connection)
        Registry.delete(self) if @born.empty?
        @opened -= 1
        grant(:open)
        true
      else
        give(hold, true)
      end
    end

    # With the lock held: to the oldest waiter, else back to the idle list.
    # @return [Waiter, false] (see #grant)
    def give(hold, hand = false)
      hold.returned_at = Clock.now if @healthy && @check_after.positive?
      granted = grant(hold, hand)
      @idle.push(hold) unless granted
      granted.equal?(true) ? false : granted
    end

    # With the lock held: hands `what` (a Hold, or :open for the right to
    # open a connection) to the oldest waiter and wakes it. With `hand`, a
    # waiter in the calling fiber's own loop is not woken but returned: the
    # caller runs it at once, once it has let go of the lock
    # (Scheduler#hand_over), so that the waiter's query goes out within the
    # same turn of the loop, and the selector does not drop and re-add the
    # connection's socket between the two fibers' waits on it.
    # @return [Boolean, Waiter] whether there was one, or the Waiter to run.
    def grant(what, hand = false)
      waiter = @waiters.shift or return false
      @opened += 1 if what.equal?(:open)
      waiter.handed = what
      if (fiber = waiter.fiber)
        scheduler = waiter.scheduler
        return waiter if hand && scheduler.equal?(Fiber.scheduler) && !Fiber.current.blocking?

        scheduler.unblock(waiter, fiber)
      else
        waiter.condition.signal
      end
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
