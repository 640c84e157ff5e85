# frozen_string_literal: true

module NeverBlock
  # A bounded set of reusable fibers: the 2009 NeverBlock::Pool::FiberPool,
  # with backpressure.
  #
  #   pool = NeverBlock::FiberPool.new(size: 50, queue_limit: 10_000)
  #   NeverBlock.run do
  #     tasks = urls.map { |url| pool.spawn { Net::HTTP.get(URI(url)) } }
  #     NeverBlock.wait_all(tasks)
  #   end
  #
  # - Never more than `size` blocks run at once; each runs in one of at most
  #   `size` fibers, which are reused rather than created per block.
  # - Blocks beyond `size` wait in FIFO order; beyond `queue_limit` waiting
  #   blocks, {#spawn} raises {PoolFull} instead of growing without bound.
  # - A fiber whose block ends waits for the next block, up to `idle_limit`
  #   fibers; beyond that it ends, so the memory a burst of blocks took
  #   (each fiber's stack pages and struct, 15-25 KB) goes back once it is
  #   over, instead of staying with `size` parked fibers.
  # - Before each block, the worker's fiber-local variables
  #   (`Thread.current[:key]`) are reset to nil, and on Ruby 3.2+ its fiber
  #   storage (`Fiber[:key]`) becomes the spawner's, as for a new fiber; so
  #   nothing leaks from one block to the next.
  #
  # A pool belongs to the event loop it is first used in; once that loop is
  # closed it can be used in a new one. It is not shared between threads.
  class FiberPool
    # Fiber storage (Fiber[:key]) is Ruby's from 3.2 (a gem backports a
    # look-alike to 3.1, which this does not try to manage).
    STORAGE = RUBY_VERSION >= "3.2"
    private_constant :STORAGE

    # @return [Integer] the most blocks that run at once.
    attr_reader :size

    # @return [Integer] the most blocks that may wait for a fiber.
    attr_reader :queue_limit

    # @return [Integer] the most fibers kept waiting for a block.
    attr_reader :idle_limit

    # Fibers kept for reuse by default, at most: enough that a steady load
    # of a few hundred concurrent blocks makes no fibers, few enough that a
    # pool of thousands gives the memory of a burst back.
    IDLE_LIMIT = 256

    # @param size [Integer] fibers in the pool (>= 1).
    # @param queue_limit [Integer] waiting blocks allowed (>= 0).
    # @param idle_limit [Integer] fibers kept waiting for the next block
    #   (>= 0; default `size` or {IDLE_LIMIT}, the smaller); the others end
    #   when their block does.
    # @raise [ArgumentError] for negative, zero-size, non-integer values.
    def initialize(size: 50, queue_limit: 10_000, idle_limit: nil)
      @size = NeverBlock.validate_size!(size, :size)
      @queue_limit = NeverBlock.validate_size!(queue_limit, :queue_limit, minimum: 0)
      @idle_limit = idle_limit ? NeverBlock.validate_size!(idle_limit, :idle_limit, minimum: 0) : [@size, IDLE_LIMIT].min
      @scheduler = nil
      @queue = []
      @idle = []
      @workers = 0
      @active = {}.compare_by_identity # task => true, running now
      @completed = 0
      @closed = false
    end

    # Runs the block in a pooled fiber, now or, if all `size` fibers are
    # busy, once one is free.
    #
    # @param defer [Boolean] true: a new fiber for the block starts on the
    #   loop's next turn, so the caller goes on without giving up its turn
    #   (a parked fiber of the pool is always handed the block that way).
    #   Should Ruby then fail to allocate its stack, the block waits for a
    #   busy fiber of the pool instead (or fails, if there is none).
    # @param detached [Boolean] true for a root task, not a child of the
    #   task spawning it ({Task::Tree}, {NeverBlock.spawn}).
    # @param internal [Boolean] @api private: see {Scheduler#spawn}.
    # @return [Task] the block's task.
    # @raise [PoolFull] when `queue_limit` blocks are already waiting.
    # @raise [PoolClosed] after {#shutdown}.
    # @raise [NoReactorError] outside {NeverBlock.run}.
    def spawn(defer: false, detached: false, internal: false, &block)
      raise ArgumentError, "FiberPool#spawn needs a block" unless block
      raise PoolClosed, "this FiberPool has been shut down" if @closed

      scheduler = bind
      if @idle.empty? && @workers >= @size && @queue.size >= @queue_limit
        raise PoolFull, "FiberPool is full: #{@size} fibers busy and #{@queue.size} blocks queued " \
                        "(queue_limit #{@queue_limit}); slow the producer down, or raise size or queue_limit"
      end

      task = Task.new(scheduler, block)
      task.storage = Fiber.current.storage if STORAGE
      scheduler.adopt(task, detached: detached, internal: internal)
      dispatch(scheduler, task, defer)
      task
    end

    # @return [Hash] `{size:, busy:, idle:, queued:, completed:}`: fibers
    #   running a block, parked fibers, blocks waiting, blocks finished.
    def stats
      { size: @size, busy: @workers - @idle.size, idle: @idle.size, queued: @queue.size, completed: @completed }
    end

    # @return [Boolean] true when every fiber is busy: a block spawned now
    #   would wait (in the queue) for one to be free.
    def full?
      @idle.empty? && @workers >= @size
    end

    # Stops accepting blocks, waits up to `timeout` seconds for running and
    # queued blocks to finish, then cancels whatever is left and retires the
    # fibers. Called inside the loop it suspends only the calling fiber.
    #
    # @param timeout [Numeric, nil] seconds; nil waits without limit.
    # @return [Boolean] true if everything finished, false if work was cancelled.
    def shutdown(timeout = nil)
      NeverBlock.validate_timeout!(timeout, :timeout) if timeout
      @closed = true
      scheduler = @scheduler
      return true unless scheduler && !scheduler.closed? && scheduler.loop_thread?

      drained = drained? || wait_drained(scheduler, timeout)
      unless drained
        @queue.dup.each(&:cancel)
        @active.keys.each(&:cancel)
        wait_drained(scheduler, nil)
      end
      retire
      drained
    end

    # @return [Boolean] true after {#shutdown}.
    def closed?
      @closed
    end

    # @api private
    # A queued task was cancelled: it gives its place up at once.
    def dequeue(task)
      @queue.delete(task)
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} #{stats.map { |key, value| "#{key}=#{value}" }.join(' ')}>"
    end

    private

    # Binds the pool to the current thread's loop on first use (or after
    # the loop it was bound to closed).
    def bind
      scheduler = NeverBlock.current_scheduler!
      return scheduler if scheduler.equal?(@scheduler)

      if @scheduler && !@scheduler.closed?
        raise Error, "this FiberPool belongs to another event loop (#{@scheduler.thread.inspect}); " \
                     "create one pool per thread"
      end
      @scheduler = scheduler
      @queue.clear
      @idle.clear
      @workers = 0
      @active.clear
      scheduler.on_close { retire }
      scheduler
    end

    def dispatch(scheduler, task, defer = false)
      if (worker = @idle.pop)
        @active[task] = true # handed over; it starts on the loop's next turn
        scheduler.wake(worker, task)
      elsif @workers < @size
        @workers += 1
        defer ? start_worker_later(scheduler, task) : start_worker(scheduler, task)
      else
        task.owner = self
        @queue << task
      end
    end

    def start_worker(scheduler, task)
      scheduler.start_fiber(new_worker(scheduler, task))
    rescue FiberError => e
      @workers -= 1
      @active.delete(task)
      task.fail_to_start(e)
    end

    def start_worker_later(scheduler, task)
      @active[task] = true # handed over; it starts on the loop's next turn
      scheduler.start_fiber_later(new_worker(scheduler, task), lambda do |error|
        @workers -= 1
        @active.delete(task)
        if @workers.zero? || @closed
          task.fail_to_start(error)
        elsif (worker = @idle.pop)
          @active[task] = true
          scheduler.wake(worker, task)
        else
          task.owner = self
          @queue.unshift(task) # the next fiber to finish a block takes it
        end
      end)
    end

    def new_worker(scheduler, task)
      Fiber.new(blocking: false) do
        fiber = Fiber.current
        while task
          work(fiber, task)
          task = next_task(scheduler, fiber)
        end
      ensure
        @workers -= 1
        scheduler.entered(nil)
        scheduler.fiber_ended(fiber)
      end
    end

    def work(fiber, task)
      @active[task] = true
      locals = Thread.current
      locals.keys.each { |key| locals[key] = nil }
      inherit_storage(task.storage) if STORAGE
      task.execute(fiber)
    ensure
      @active.delete(task)
      @completed += 1
      @drain_waiter && scheduler_wake_drain
    end

    # The next queued task, or parks the fiber until {#dispatch} hands it
    # one; nil when the pool retires it (closed, or `idle_limit` fibers
    # wait already).
    def next_task(scheduler, fiber)
      while (task = @queue.shift)
        task.owner = nil
        return task if task.status == :pending
      end
      return nil if @closed || @idle.size >= @idle_limit

      @idle << fiber
      parked = true
      while true # rubocop:disable Style/InfiniteLoop -- Kernel#loop costs a block call per wake-up
        handed = scheduler.suspend # dispatch hands a Task; retire hands :retire
        parked = false
        return handed if handed.is_a?(Task)
        return nil if handed == :retire

        parked = true
      end
    ensure
      @idle.delete(fiber) if parked
    end

    # Gives the worker the spawner's Fiber storage. Fiber#storage= would do
    # it in one call but warns that it is experimental; Fiber[]= does not.
    def inherit_storage(storage)
      current = Fiber.current.storage
      current&.each_key { |key| Fiber[key] = nil unless storage&.key?(key) }
      storage&.each { |key, value| Fiber[key] = value }
    end

    def drained?
      @active.empty? && @queue.empty?
    end

    def wait_drained(scheduler, timeout)
      @drain_waiter = Fiber.current
      scheduler.wait_until(timeout) { drained? }
    ensure
      @drain_waiter = nil
    end

    def scheduler_wake_drain
      @scheduler.wake(@drain_waiter) if drained?
    end

    # Wakes the parked fibers with nothing to do, so they end.
    def retire
      idle = @idle
      @idle = []
      idle.each { |fiber| @scheduler.wake(fiber, :retire) }
    end
  end
end
