# frozen_string_literal: true

require "io/event"
require "socket"

require_relative "errors"
require_relative "task"
require_relative "selector"
require_relative "timers"
require_relative "thread_pool"
require_relative "stall_detector"
require_relative "fork_hook"
require_relative "scheduler/failures"
require_relative "scheduler/wakeup"
require_relative "scheduler/blocking_hooks"
require_relative "scheduler/io_hooks"
require_relative "scheduler/fiber_hooks"
require_relative "scheduler/threads"
require_relative "scheduler/interrupts"
require_relative "scheduler/fork"
require_relative "scheduler/blocking_work"
require_relative "scheduler/lateness"
require_relative "scheduler/wait_deadlines"

module NeverBlock
  # NeverBlock's implementation of Ruby's `Fiber::Scheduler` interface: one
  # event loop per thread, built on an io-event selector (EPoll by default).
  #
  # Most code never touches it directly: {NeverBlock.run} creates one, sets
  # it as the thread's fiber scheduler and closes it. It can also be used the
  # raw way, like any Fiber::Scheduler:
  #
  #   Thread.new do
  #     Fiber.set_scheduler(NeverBlock::Scheduler.new)
  #     Fiber.schedule { Net::HTTP.get(uri) }
  #   end.join # the loop runs when the thread ends (Scheduler#close)
  #
  # How a fiber waits: it either sits in the selector (IO, child processes),
  # or in {#suspend} with a wake-up token. Anything that may resume it later
  # (a timer, {#unblock}, a finished task, a thread-pool job) goes through
  # {#wake}, which only resumes the fiber if it is still in the same wait, so
  # a late wake-up can never resume a fiber in the middle of another wait.
  #
  # Every method is called on the scheduler's own thread unless its comment
  # says otherwise.
  #
  # This file is the core, to be read top to bottom: construction, the
  # task and fiber lifecycle ({#run}, {#spawn}, #start), the wait/wake
  # protocol ({#suspend}, {#wake}, {#wake_next}) and the ready queue it
  # fills, {#close}, then the loop itself (#run_loop, #run_once,
  # #run_ready). The other jobs have files of their own under scheduler/:
  #
  #   blocking_hooks.rb BlockingHooks: block, unblock and kernel_sleep
  #                     (Mutex, Queue, ConditionVariable, sleep), and
  #                     wait_until, all built on suspend/wake
  #   io_hooks.rb       IOHooks: io_wait, io_read/io_write/io_pread,
  #                     io_select, and IOs closed under a waiting fiber
  #   fiber_hooks.rb    FiberHooks: Fiber.schedule (fiber), yield,
  #                     transfer, and fibers user code moves by hand
  #   threads.rb        Threads: binding to a thread, post and the inbox
  #                     it fills, other threads waiting on a task
  #   blocking_work.rb  BlockingWork: defer, DNS, process_wait and
  #                     offload (blocking_operation_wait, Ruby 4.0+), off
  #                     the loop
  #   interrupts.rb     Interrupts: raising in a fiber at its wait
  #                     (Task#cancel, timeouts, IO#timeout)
  #   fork.rb           Fork: a forked child detaching from the loop
  #   wakeup.rb         Wakeup: the inbox other threads post to, the pipe
  #                     and fiber that wake the loop, parking
  #   failures.rb       Failures: logging tasks that failed unobserved
  #
  # The modules are included here and share the scheduler's state (set up
  # in #initialize, which says whose each part is); Wakeup and Failures
  # are objects with their own. Each file's header says who calls it, when,
  # and from which thread.
  class Scheduler
    # Marks a @ready entry that starts a task or a raw fiber.
    START = :start
    # Marks a @ready entry that resumes a fiber displaced by a plain
    # Fiber#raise or #transfer (see #run_ready).
    RESUME = :resume
    # Fibers a turn of the loop may switch to directly, past the loop
    # (#wake_next).
    DIRECT_SWITCHES = 256
    private_constant :START, :RESUME, :DIRECT_SWITCHES

    include BlockingHooks
    include IOHooks
    include FiberHooks
    include Threads
    include Lateness
    include Interrupts
    include Fork
    include BlockingWork

    # io-event records a fiber waiting in a selector as a node on that fiber's
    # own stack, linked into the selector's list for the descriptor; only the
    # fiber's return from the wait unlinks it. A selector the GC frees with a
    # node still linked writes into that node; but the fiber may have been
    # freed first and its stack reused by a fiber waiting in another selector,
    # whose list then loops on itself: the next GC mark spins forever. So a
    # selector closed while fibers still wait in it (a loop that failed, a
    # forked child's copy) is kept, with those fibers, until the process exits.
    @stranded = []

    # @api private
    # Keeps `selector` from ever being freed (see above).
    # @return [void]
    def self.strand(selector)
      @stranded << selector
    end

    # @return [Thread] the thread whose event loop this is.
    attr_reader :thread

    # @return [Class] the io-event selector class in use.
    attr_reader :selector_class

    # @param selector [String, Symbol, nil] `:epoll`, `:uring` or `:select`;
    #   defaults to `ENV["NEVERBLOCK_SELECTOR"]`, else EPoll.
    # @param stall_threshold [Numeric, nil] seconds a fiber may hold the loop
    #   before a warning is logged; nil or false turns the detector off.
    #   Defaults to {NeverBlock.stall_threshold}.
    # @param thread_pool_size [Integer] threads for {#defer}, DNS and other
    #   blocking work. Defaults to {NeverBlock.thread_pool_size}.
    def initialize(selector: nil, stall_threshold: NeverBlock.stall_threshold,
                   thread_pool_size: NeverBlock.thread_pool_size)
      NeverBlock.validate_size!(thread_pool_size, :thread_pool_size)
      NeverBlock.validate_timeout!(stall_threshold, :stall_threshold) if stall_threshold
      @pid = Process.pid
      @selector_class = Selector.resolve(selector)
      @select_full = full_select(@selector_class) # (Lateness)
      @timers = Timers.new
      # Shared timer callbacks: a sleep or a lock timeout (BlockingHooks)
      # allocates no closure.
      @wake_callback = method(:wake)
      @expire_callback = ->(fiber) { wake(fiber, false) }

      @ready = [] # flat triples: fiber (or task), token, value
      @ready_spare = nil # the array #run_ready last emptied, for the next turn
      # Every fiber parked by NeverBlock => how: the Integer token of its wait
      # in #suspend, :io while the selector has it, :queued while it waits in
      # the selector's ready queue. A fiber the loop ran that is in none of
      # these was displaced by user code (Fiber#raise) and is rescheduled.
      @waits = {}.compare_by_identity
      @unblockable = {}.compare_by_identity # fibers in #block or #kernel_sleep (BlockingHooks)
      @sleeping_forever = 0 # fibers in a Kernel#sleep without a duration (BlockingHooks)
      # #wake_next's fiber, the token of its wait and its value, until the
      # caller suspends; switches past the loop left this turn.
      @runs_next = @runs_next_token = @runs_next_value = nil
      @direct_switches = DIRECT_SWITCHES
      @released = {}.compare_by_identity # fibers that left the loop's care (FiberHooks)
      @token = 0
      @tasks = {}.compare_by_identity # live tasks => true
      @io_waiting = 0 # fibers waiting in the selector
      @io_behind_since = nil # when the selector's calls began to come back full (Lateness)
      @idle = 0.0 # seconds the loop has waited for IO or timers, nothing to run (Lateness)

      # IOHooks' own: an IO wait's timeout (its timer kept from wait to wait,
      # and no closure made for it).
      @wait_deadlines = WaitDeadlines.new(@timers, ->(fiber) { fiber.transfer(false) })
      @close_sweep = method(:interrupt_closed_waits)
      @close_watch = nil # the timer looking for IOs closed under a waiting fiber

      @wakeup = Wakeup.new # how other threads hand the loop work and wake it
      @inbox = @wakeup.inbox # read every turn: a direct reference keeps that check one call
      # Threads' own: threads other than the loop's waiting for a task
      # (#wait_from_other_thread).
      @foreign_lock = Thread::Mutex.new
      @foreign_cond = Thread::ConditionVariable.new
      @foreign_waiters = 0

      @thread_pool = ThreadPool.new(thread_pool_size)
      @stall_detector = StallDetector.new(self, stall_threshold) if stall_threshold
      @close_hooks = []
      @running = nil # the non-loop fiber that holds the loop right now
      @switches = 0 # bumped each time a fiber is (re)entered; read by the stall detector
      @closed = false
      @managed = false # true once #run got a block (NeverBlock.run): raw fibers fail like tasks
      @aborted = false
      @collected_at = nil # when start last ran the GC to free fiber stacks
      @forked = false # set in a forked child (Fork)
      @failures = Failures.new # failed tasks nobody waited for, logged later
      @loop_depth = 0 # #run_loop calls in progress (a blocking fiber may run the loop again)
      @raw_failure = nil # the first failure of a raw Fiber.schedule fiber, to raise from the loop
      bind_thread
    end

    # @api private
    # Read by the stall detector's thread.
    attr_reader :running, :switches

    # @return [Boolean] true once {#close} has run.
    def closed?
      @closed
    end

    # @return [Integer] stalls its stall detector reported (0 without one).
    def stalls
      @stall_detector ? @stall_detector.stalls : 0
    end

    # @return [Array<Task>] the tasks that are pending or running.
    def tasks
      @tasks.keys
    end

    # Runs `block` as the first task and the loop until every task has
    # finished. The scheduler must already be the thread's fiber scheduler.
    #
    # Without a block, runs the loop until no work is left (every fiber
    # started with `Fiber.schedule` has finished), as Ruby's own reference
    # scheduler does; {#close} does the same when the thread ends.
    #
    # @return [Object] the block's value; nil without a block.
    # @raise [Exception] whatever the block raised; without a block, the
    #   first exception that escaped a `Fiber.schedule` fiber.
    def run(&block)
      claim_thread
      # The watchdog starts with the loop, not with the scheduler: a thread
      # sleeping with a timeout would hide a deadlock from Ruby (say, the
      # thread's root fiber blocking on a Mutex before the loop runs).
      @stall_detector&.start
      return run_loop unless block

      @managed = true
      task = spawn(observed: true, &block)
      begin
        run_loop
      rescue Exception # rubocop:disable Lint/RescueException -- the loop itself failed: close cancels the rest
        @aborted = true
        raise
      end
      task.value
    end

    # Creates a task and runs it at once, until its first wait; the caller
    # continues on the next turn of the loop. Called from the loop fiber
    # itself (outside any task), the task starts on the next turn instead.
    #
    # The task is a child of the task that spawns it ({Task::Tree}), unless
    # `detached`: then it is a root, which records where it was spawned
    # ({Task#spawned_at}) and joins the scope of the spawning task's tree
    # (a server's, for one spawned from a request: {Server::AppTasks}).
    #
    # @param observed [Boolean] true if the caller will collect the result,
    #   so a failure is not logged.
    # @param detached [Boolean] true for a root task, which nothing cancels
    #   when the spawning task ends.
    # @param internal [Boolean] @api private: with `detached`, a task of
    #   NeverBlock's own (a server's accept loop, a log flush), which records
    #   nothing and belongs to no scope: whoever started it ends it.
    # @return [Task]
    # @raise [ClosedError] after {#close}.
    def spawn(observed: false, detached: false, internal: false, &block)
      raise ArgumentError, "spawn needs a block" unless block
      raise ClosedError, "this NeverBlock scheduler is closed" if @closed

      claim_thread

      task = Task.new(self, block, observed: observed)
      place(task, detached, internal)
      @tasks[task] = true
      start(task)
      task
    end

    # @api private
    # Registers a task created elsewhere (FiberPool) as live, so the loop
    # runs until it finishes; placed in the tree as {#spawn} places it.
    def adopt(task, detached: false, internal: false)
      raise ClosedError, "this NeverBlock scheduler is closed" if @closed

      place(task, detached, internal)
      @tasks[task] = true
    end

    # @api private
    # Starts a raw fiber now, as #spawn starts a task.
    # @raise [FiberError] when Ruby cannot allocate its stack.
    def start_fiber(fiber)
      start(fiber)
    end

    # @api private
    # Starts a raw fiber on the loop's next turn, after what is ready now,
    # rather than switching to it at once: a fiber starting many (the
    # server's acceptor taking in a backlog of connections) goes on without
    # giving up its turn for each. `on_failure` is called with the
    # FiberError if Ruby cannot allocate the fiber's stack then.
    # @param fiber [Fiber]
    # @param on_failure [#call]
    # @return [void]
    def start_fiber_later(fiber, on_failure)
      @ready.push(fiber, START, on_failure)
    end

    # --- Waiting and waking ------------------------------------------------

    # Suspends the current (non-blocking) fiber until {#wake} resumes it.
    # Callers re-check their condition afterwards: being resumed only means
    # "look again" (a timeout, a cancel, a finished task).
    #
    # @return [Object] the value passed to {#wake}.
    def suspend
      exit_forked_child if @forked
      fiber = Fiber.current
      @waits[fiber] = (@token += 1)
      @running = nil
      following = runs_next if @runs_next
      return @loop.transfer unless following

      following.transfer(@runs_next_value)
    ensure
      @waits.delete(fiber)
      entered(fiber)
    end

    # Schedules a fiber suspended in {#suspend} to resume on the next turn of
    # the loop. Does nothing if the fiber is not suspended there.
    #
    # @param value [Object] returned by the fiber's {#suspend}.
    # @return [Boolean] whether the fiber was scheduled.
    def wake(fiber, value = true)
      token = @waits[fiber]
      return false unless token.is_a?(Integer)

      @ready.push(fiber, token, value)
      true
    end

    # @api private
    # Schedules `fiber`, suspended in {#suspend}, to resume as {#wake} does,
    # and lets it run next: when the calling fiber next suspends (a wait in
    # {#suspend}: a pool's, a Mutex's, a sleep), it switches straight to
    # `fiber` instead of to the loop, and `fiber` runs in its place. The
    # caller runs on meanwhile, undisturbed; one that ends leaves `fiber` to
    # the loop's next turn, as {#wake} would.
    #
    # For a caller that has just handed `fiber` what it waits for (a pool's
    # checkin hands it a connection): `fiber` acts within this turn of the
    # loop (its query is sent before the selector looks at the connection's
    # socket again, which keeps that socket registered), at one fiber
    # switch, where running it at once and the caller after it from the
    # ready queue took two. A caller that next waits on IO instead lets
    # `fiber` run first, then waits one turn on the ready queue (#give_way:
    # the selector's wait cannot switch to another fiber). At most
    # DIRECT_SWITCHES fibers a turn run this way, so that fibers that keep
    # handing each other something without waiting on IO cannot hold the
    # loop.
    #
    # Called from another thread, or from a fiber the loop cannot switch
    # away from (the loop itself, a blocking fiber), it is {#unblock} or
    # {#wake}.
    # @param value [Object] returned by `fiber`'s {#suspend}.
    # @return [void]
    def wake_next(fiber, value = true)
      return unblock(nil, fiber) unless loop_thread?
      return unless wake(fiber, value) && !Fiber.current.blocking?

      @runs_next = fiber
      @runs_next_token = @waits[fiber]
      @runs_next_value = value
    end

    # @api private
    # Called by a fiber about to wait in the selector (IOHooks#in_selector)
    # while the fiber #wake_next woke has not run yet: the selector's wait
    # switches to the loop, never to another fiber, so `fiber` lets that
    # one run first, now, and waits on the ready queue meanwhile; it goes
    # on to its IO wait on the loop's next turn, and only then starts the
    # wait's timer, which must not run down meanwhile. An interrupt aimed
    # at it meanwhile is raised here, at the start of its wait.
    # @return [void]
    def give_way(fiber)
      following = runs_next or return

      token = (@token += 1)
      @waits[fiber] = token
      @ready.push(fiber, token, true)
      @running = nil
      following.transfer(@runs_next_value)
    ensure
      if token
        @waits.delete(fiber)
        entered(fiber)
      end
    end

    # @api private
    # Schedules `callable.call(argument)` on this loop in `seconds`; call it
    # on the loop's thread only (from one of its fibers or callbacks).
    # @return [Timers::Timer, nil] nil for an infinite delay (it never fires).
    def add_timer(seconds, callable, argument = nil)
      @timers.after(seconds, callable, argument)
    end

    # --- Closing -----------------------------------------------------------

    # Fiber::Scheduler hook (Ruby 3.4+): called instead of #close when the
    # thread ends or `Fiber.set_scheduler` replaces this scheduler.
    # @return [void]
    def scheduler_close
      close
    end

    # Fiber::Scheduler hook: called by `Fiber.set_scheduler(nil)` and when
    # the thread exits. Runs the loop until every task has finished (after
    # an aborted {#run}, cancels them first), then releases the selector,
    # the thread pool and the stall detector. Idempotent.
    # @return [void]
    def close
      return if @closed
      return forked_close if @forked || Process.pid != @pid

      claim_thread
      raise Error, "close the scheduler from its own thread (#{@thread.inspect})" unless loop_thread?
      raise Error, "close cannot be called from inside a task" unless Fiber.current.equal?(@loop)

      begin
        cancel_all if @aborted
        run_loop
      ensure
        @closed = true
        @failures.report
        @close_hooks.each(&:call)
        run_ready # lets fibers retired by the hooks finish
        @stall_detector&.stop
        @thread_pool.shutdown
        @wakeup.close
        Scheduler.strand(@selector) if @io_waiting.positive?
        @selector.close
      end
    end

    # @api private
    # Registers a callable to run in {#close} (FiberPool retires its fibers).
    def on_close(&block)
      @close_hooks << block
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} #{@selector_class.name.split('::').last} tasks=#{@tasks.size}#{' closed' if @closed}>"
    end

    # --- Internals shared with Task, FiberPool and the thread pool ----------

    # @api private
    def task_started
      entered(Fiber.current)
    end

    # @api private
    def task_finished(task, report)
      @tasks.delete(task)
      if report && task.raw? && !@managed
        # Raw Fiber.schedule use, as with Ruby's reference scheduler: the
        # exception leaves the loop (#run or #close), and so reaches
        # Thread#join. Under NeverBlock.run it is logged like a task's.
        @raw_failure ||= task.error
      elsif report
        @failures.record(task)
      end
      signal_foreign_waiters if @foreign_waiters.positive?
    end

    # @api private
    # Creates the fiber that runs a task; the fiber ends with the task.
    def new_task_fiber(task)
      Fiber.new(blocking: false) do
        task.execute(Fiber.current)
      ensure
        @running = nil
        fiber_ended(Fiber.current)
        @released.delete(Fiber.current) unless @released.empty?
        # In a forked child; an exception on its way out ends the child itself.
        exit_forked_child(task) if @forked && !$!
      end
    end

    # @api private
    # `fiber`, one of the loop's (a task's, a FiberPool's), has ended: the
    # timer its timed IO waits kept goes (WaitDeadlines#finished).
    # @return [void]
    def fiber_ended(fiber)
      @wait_deadlines.finished(fiber)
    end

    # @api private
    # Records that `fiber` now holds the loop (for the stall detector).
    def entered(fiber)
      @running = fiber
      @switches += 1
    end

    private

    # --- Waking a fiber next -----------------------------------------------

    # The fiber #wake_next woke, taken for a direct switch (@runs_next is
    # cleared): nil unless it is still in the wait it was woken from (else
    # its @ready entry is stale, skipped by #run_ready) and the turn has
    # switches past the loop left.
    def runs_next
      following = @runs_next
      @runs_next = nil
      return nil unless @waits[following] == @runs_next_token && @direct_switches.positive?

      @direct_switches -= 1
      following
    end

    # --- Starting ----------------------------------------------------------

    # A new task's place in the tree ({#spawn}): a child of the spawning
    # task, NeverBlock's own root, or the app's.
    def place(task, detached, internal)
      if !detached
        Task.current&.adopt_child(task)
      elsif internal
        task.internal!
      else
        task.root_from(Task.current, true)
      end
    end

    # Starts a task (or a raw fiber) at once; it runs until its first wait.
    # From a task, the caller waits meanwhile in the selector's ready queue;
    # from the loop fiber it is a plain transfer. From some other blocking
    # fiber (Fiber.blocking, an Enumerator on Ruby 3.1), which a transfer
    # would strand, the start waits for the loop's next turn.
    def start(target)
      current = Fiber.current
      if current.blocking? && !current.equal?(@loop)
        @ready.push(target, START, nil)
        return
      end
      if target.is_a?(Task)
        return unless target.status == :pending

        fiber = new_task_fiber(target)
      else
        fiber = target
      end
      if current.blocking?
        fiber.transfer
        reschedule_if_displaced(fiber)
      else
        queued { @selector.resume(fiber) }
      end
    rescue FiberError => e
      # Ruby could not allocate the fiber's stack (too many live fibers for
      # vm.max_map_count, or memory). Dead fibers the GC has not collected
      # yet still hold stacks, so collect and retry, at most once a second
      # (a GC per failure would stall the loop); else a task fails and the
      # loop goes on, and for a raw fiber the caller hears of it.
      clock = Clock.now
      if @collected_at.nil? || clock - @collected_at > 1
        @collected_at = clock
        GC.start
        retry
      end
      raise unless target.is_a?(Task)

      target.fail_to_start(e)
    end

    def start_deferred(target, on_failure)
      start(target)
    rescue FiberError => e
      return on_failure.call(e) if on_failure

      NeverBlock.logger.error("NeverBlock") { "could not start #{target.inspect}: #{e.message}" }
    end

    # Runs a selector call that parks the current fiber in the selector's
    # ready queue (resume, raise) while another fiber runs.
    def queued
      fiber = Fiber.current
      @waits[fiber] = :queued
      @running = nil
      yield
    ensure
      @waits.delete(fiber)
      entered(fiber)
    end

    # --- The loop ----------------------------------------------------------

    def run_loop
      @stall_detector&.start
      @loop_depth += 1
      @wakeup.start_watching if @loop_depth == 1
      begin
        raise_raw_failure if @raw_failure # e.g. a fiber that failed as it started
        until @tasks.empty?
          run_once
          raise_raw_failure if @raw_failure
        end
      ensure
        @loop_depth -= 1
        @wakeup.stop_watching if @loop_depth.zero?
      end
    end

    def raise_raw_failure
      error = @raw_failure
      @raw_failure = nil
      raise error
    end

    # One turn: run what is ready, wait for IO or the next timer, fire timers.
    def run_once
      @runs_next = nil
      @direct_switches = DIRECT_SWITCHES
      drain_inbox unless @inbox.empty?
      run_ready
      return if @tasks.empty? || @raw_failure

      @wait_deadlines.clear if @io_waiting.zero? # no timed wait under way: none of their timers is needed
      interval = @ready.empty? && @inbox.empty? && !@selector.ready? ? @timers.wait_interval : 0
      interval = 0 if interval&.negative?
      @failures.report if @failures.due?(interval)
      # The loop is about to wait: no fiber holds it, whatever ran last (the
      # wake-up's watcher reads its pipe through the io_read hook, which marks
      # it running, and parks in the selector without going through #suspend).
      @running = nil
      # Parked, the loop is a deadlock to Ruby when no other thread can wake
      # it. A fiber in a plain `sleep` makes it none: as a thread's `sleep`,
      # it waits for a signal (the selector waits, as for IO).
      if interval.nil? && @io_waiting.zero? && @sleeping_forever.zero?
        @io_behind_since = nil
        parked_at = Clock.now
        @wakeup.park(@stall_detector)
        @idle += Clock.now - parked_at
      else
        selected(@selector.select(interval))
        # (the call runs the fibers it wakes: only its wait is idle)
        @idle += @selector.idle_duration
      end
      @timers.fire
    end

    # Runs what was ready when the turn began; what becomes ready meanwhile
    # waits for the next turn. Two arrays take turns (a nested loop, run
    # from a blocking fiber, finds no spare and makes one), so a turn
    # allocates nothing.
    def run_ready
      ready = @ready
      return if ready.empty?

      @ready = @ready_spare || []
      @ready_spare = nil
      index = 0
      while index < ready.size
        target = ready[index]
        token = ready[index + 1]
        value = ready[index + 2]
        index += 3
        if token.equal?(START)
          start_deferred(target, value)
        elsif token.equal?(RESUME)
          resume_displaced(target)
        elsif @waits[target] == token
          target.transfer(value)
          reschedule_if_displaced(target)
        end
      end
      ready.clear
      @ready_spare = ready
    end

    # The loop failed (an Interrupt, say): every task is cancelled, once; a
    # child its parent already cancelled is left to its cleanup, and what a
    # cancelled task spawns meanwhile is not in the list iterated.
    def cancel_all
      @tasks.keys.each { |task| task.cancel if task.alive? && !task.cancel_requested? }
    end
  end
end
