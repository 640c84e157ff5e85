# frozen_string_literal: true

module NeverBlock
  # Tasks started together and ended together: the scope for the common
  # shapes of concurrent work.
  #
  #   # all or fail: both results, or the first failure with the other cancelled
  #   user, orders = NeverBlock.group do |group|
  #     group.spawn { User.find(id) }
  #     group.spawn { Order.where(user_id: id).to_a }
  #   end
  #
  #   # first wins: the fastest replica's answer, the others cancelled
  #   NeverBlock.race do |group|
  #     replicas.each { |replica| group.spawn { replica.get(key) } }
  #   end
  #
  #   # every one, failures collected: a crawler that keeps what it fetched
  #   group = NeverBlock::Group.new(limit: 20, fail_fast: false)
  #   urls.each { |url| group.spawn(url) { fetch(url) } }
  #   pages = begin
  #     group.wait
  #   rescue NeverBlock::GroupError => e
  #     e.failures.each { |failure| warn "#{failure.item}: #{failure.error.message}" }
  #     e.values # nil where a task failed
  #   end
  #
  # A group's tasks are children of the task that made it (Task::Tree),
  # so cancelling that task reaches them too; no task of a group outlives
  # {#wait} or {#first}. With `limit:`, at most that many run at once and
  # {#spawn} waits for a free place ({NeverBlock.map} is a group so).
  #
  # Made and used on one event loop's thread.
  class Group
    # One task's failure: the error, the task, its place in spawn order
    # (for {NeverBlock.map}, the item's index in the input) and the item
    # given to {Group#spawn} (for map, the input item; nil when none was).
    Failure = Struct.new(:error, :task, :index, :item) do
      # @return [String] e.g. `task 3 (item "https://example.com/a"): KeyError: key not found: :id`.
      def to_s
        label = item.nil? ? "" : " (item #{item.inspect.then { |text| text.size > 80 ? "#{text[0, 77]}..." : text }})"
        "task #{index}#{label}: #{error.class}: #{error.message}"
      end
    end

    # @return [Array<Failure>] every task's failure so far, in the order
    #   they happened, each with its task, index and item (a task cancelled
    #   by the group is not a failure).
    attr_reader :failures

    # @return [Integer] how many tasks were spawned.
    attr_reader :size

    # @param limit [Integer, nil] at most this many tasks run at once; nil
    #   for no limit.
    # @param fail_fast [Boolean] true: the first failure stops the group at
    #   once (the others are cancelled, nothing more starts) and {#wait}
    #   raises it; false: every task runs to its end and {#wait} then
    #   raises a {GroupError} with every failure and every value ({#first},
    #   the race, skips failures while a task may still win).
    # @raise [ArgumentError] for a limit that is not an Integer >= 1, or a
    #   fail_fast that is not true or false.
    def initialize(limit: nil, fail_fast: true)
      NeverBlock.validate_size!(limit, :limit) if limit
      unless fail_fast == true || fail_fast == false
        raise ArgumentError, "fail_fast must be true (stop at the first failure) or false (run every task), " \
                             "got #{fail_fast.inspect}"
      end

      @limit = limit
      @fail_fast = fail_fast
      @scheduler = nil
      @size = 0
      @live = {} # index => task still running
      @results = []
      @failures = []
      @running = 0
      @waiter = nil
      @won = false
      @first = nil
      @stopped = false
    end

    # Starts the block as a task of the group, now; with a `limit`, first
    # waits until fewer than `limit` of the group's tasks run. After the
    # group stopped (a failure, a winner, #cancel) nothing starts.
    #
    # @param item [Object, nil] what the task works on (a URL, a record):
    #   kept with its {Failure} if it fails, so that {#failures} and
    #   {GroupError} name it. The block is not given it.
    # @return [Task, nil] the task; nil when the group has stopped.
    # @raise [NoReactorError] outside {NeverBlock.run}.
    def spawn(item = nil, &block)
      raise ArgumentError, "Group#spawn needs a block" unless block

      wait_for { @stopped || @running < @limit } if @limit
      return nil if @stopped

      @scheduler ||= NeverBlock.current_scheduler!
      @running += 1
      index = @size
      @size += 1
      task = @scheduler.spawn(observed: true) { run(index, item, block) }
      # spawn ran the block up to its first wait: it may be done already
      @live[index] = task if task.alive?
      task
    end

    # Waits for the group's tasks. With fail_fast (the default) the first
    # failure ends the wait at once, the others cancelled and waited for,
    # and is raised as it is. Without, every task runs to its end, and if
    # any failed a {GroupError} is raised with every failure and every
    # value. Cancelled or timed out while it waits, it cancels the tasks.
    #
    # @return [Array] the tasks' values, in the order they were spawned.
    # @raise [Exception] with fail_fast, the first failure.
    # @raise [GroupError] without fail_fast, when a task failed (its cause
    #   is the first failure).
    def wait
      wait_for { @running.zero? || (@fail_fast && !@failures.empty?) }
      stop
      values = @results.fill(nil, @results.size...@size)
      return values if @failures.empty?
      raise @failures.first.error if @fail_fast

      raise GroupError.new(@failures, values), cause: @failures.first.error
    ensure
      stop
    end

    # Waits for the first task to return, cancels the others and returns
    # its value. Failures are skipped while a task may still succeed.
    #
    # @return [Object] the first value returned.
    # @raise [Exception] the first failure, when every task failed.
    # @raise [Error] when no task was spawned.
    def first
      raise Error, "Group#first: no task was spawned" if @size.zero?

      wait_for { @running.zero? || @won }
      stop
      return @first if @won

      raise @failures.first.error
    ensure
      stop
    end

    # Cancels the group's tasks still running and waits for them to end;
    # nothing starts in it afterwards.
    # @return [self]
    def cancel
      stop
      self
    end

    # @return [Array<Exception>] the errors of {#failures}, alone.
    def errors
      @failures.map(&:error)
    end

    # @return [Boolean] true once a task failed.
    def failed?
      !@failures.empty?
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} size=#{@size} running=#{@running} failures=#{@failures.size}" \
        "#{" limit=#{@limit}" if @limit}#{' stopped' if @stopped}>"
    end

    private

    def run(index, item, block)
      value = @results[index] = block.call
      unless @won
        @won = true
        @first = value
      end
      value
    rescue Exception => e # rubocop:disable Lint/RescueException -- the group reports every failure
      failed(e, index, item)
      raise
    ensure
      @running -= 1
      @live.delete(index)
      @scheduler.wake(@waiter) if @waiter
    end

    # A task failed: recorded (unless it is the group's own cancel), and
    # with fail_fast the others are cancelled now; #wait or #first waits
    # for them.
    def failed(error, index, item)
      return if @stopped && error.is_a?(Cancelled)

      current = Task.current
      @failures << Failure.new(error, current, index, item)
      return unless @fail_fast

      @stopped = true
      @live.values.each { |task| task.cancel unless task.equal?(current) }
    end

    # Stops the group: what still runs is cancelled and waited for.
    def stop
      @stopped = true
      return if @live.empty?

      live = @live.values
      live.each(&:cancel)
      live.each(&:wait)
    end

    def wait_for(&condition)
      @scheduler ||= NeverBlock.current_scheduler!
      @waiter = Fiber.current
      @scheduler.wait_until(&condition)
    ensure
      @waiter = nil
    end
  end
end
