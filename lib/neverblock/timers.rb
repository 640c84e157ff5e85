# frozen_string_literal: true

module NeverBlock
  # The loop's timers: a binary min-heap of deadlines on the monotonic clock.
  #
  # Written for the loop's hot paths (every sleep, timeout and IO deadline
  # makes one): sifting allocates nothing, and a timer calls a shared
  # callable with one argument, so scheduling a wake-up needs no closure.
  # Cancelled timers are dropped lazily when they reach the top, and the heap
  # is compacted when they make up most of it (timeouts are nearly always
  # cancelled, and would otherwise pile up).
  class Timers
    # One scheduled call.
    class Timer
      # @return [Float] when it fires, in monotonic seconds.
      attr_reader :deadline

      def initialize(deadline, callable, argument)
        @deadline = deadline
        @callable = callable
        @argument = argument
      end

      # Stops the timer from firing; use {Timers#cancel}, which also keeps
      # the heap's count of cancelled timers.
      # @api private
      def cancel!
        @callable = nil
        @argument = nil
      end

      # @return [Boolean]
      def cancelled?
        @callable.nil?
      end

      # @api private
      def fire
        callable = @callable
        return unless callable

        @callable = nil
        callable.call(@argument)
      end
    end

    def initialize
      @heap = []
      @cancelled = 0
      @late = 0.0
    end

    # Schedules `callable.call(argument)` after `seconds`, or the block.
    # An infinite delay never fires: no timer is made.
    #
    # The hooks pass on what was given to `sleep`, `Timeout.timeout`,
    # `ConditionVariable#wait` or `IO#wait_readable`, which Ruby takes as
    # any number of seconds, ActiveSupport::Duration (`sleep 1.second`)
    # included: it is made a Float here, so every deadline in the heap is
    # one (the selector takes nothing else as its wait).
    # @param seconds [Numeric, ActiveSupport::Duration]
    # @return [Timer, nil]
    # @raise [ArgumentError] for NaN or -Infinity.
    # @raise [TypeError] for a delay that is not a number.
    def after(seconds, callable = nil, argument = nil, &block)
      seconds = Timers.delay(seconds) or return nil

      at(Clock.now + seconds, callable || block, argument)
    end

    # Schedules `callable.call(argument)` at `deadline` (monotonic seconds,
    # a Float: {Clock.now} plus a {.delay}).
    # @api private
    # @return [Timer]
    def at(deadline, callable, argument = nil)
      timer = Timer.new(deadline, callable, argument)
      push(timer)
      timer
    end

    # A delay as {#after} takes it, made a Float.
    # @param seconds [Numeric, ActiveSupport::Duration]
    # @return [Float, nil] nil for an infinite delay (never).
    # @raise [ArgumentError] for NaN or -Infinity.
    # @raise [TypeError] for a delay that is not a number.
    def self.delay(seconds)
      unless Float === seconds || Integer === seconds # not is_a?: a Duration says it is a Float
        raise TypeError, "timer delay must be a number of seconds, got #{seconds.inspect}" unless seconds.is_a?(Numeric)

        seconds = seconds.to_f
      end
      return seconds.to_f if seconds.finite?
      return nil if seconds.infinite? == 1

      raise ArgumentError, "timer delay must be a number of seconds, got #{seconds.inspect}"
    end

    # Cancels a timer, compacting the heap when cancelled timers dominate.
    # @param timer [Timer, nil]
    # @return [void]
    def cancel(timer)
      return if timer.nil? || timer.cancelled?

      timer.cancel!
      @cancelled += 1
      compact if @cancelled > 64 && @cancelled * 2 > @heap.size
    end

    # @return [Float, nil] seconds until the next timer (<= 0 when one is
    #   due), nil when there is none.
    def wait_interval(now = nil)
      drop_cancelled
      top = @heap.first
      top && top.deadline - (now || Clock.now)
    end

    # Timers a call of {#fire} fires, at the least, for its lateness to
    # count ({#late}): a loop's own samplers and an app's zero-second waits
    # fire one or two at the end of every turn, late by the turn.
    MANY = 4

    # @return [Float] seconds the first timer the last {#fire} fired was
    #   late, when it fired {MANY} or more (0.0 otherwise): how far behind
    #   the loop's scheduled work is.
    attr_reader :late

    # Fires every timer whose deadline has passed.
    # @return [void]
    def fire(now = nil)
      @late = 0.0
      return if @heap.empty?

      now ||= Clock.now
      first = nil
      fired = 0
      while (top = @heap.first) && top.deadline <= now
        pop
        if top.cancelled?
          @cancelled -= 1
        else
          first ||= top.deadline # the first fired is the latest
          fired += 1
          top.fire
        end
      end
      @late = now - first if fired >= MANY
    end

    # @return [Integer] timers waiting to fire (cancelled ones excluded).
    def size
      @heap.size - @cancelled
    end

    private

    def drop_cancelled
      while (top = @heap.first) && top.cancelled?
        pop
        @cancelled -= 1
      end
    end

    def push(timer)
      heap = @heap
      index = heap.size
      deadline = timer.deadline
      while index.positive?
        parent_index = (index - 1) >> 1
        parent = heap[parent_index]
        break if parent.deadline <= deadline

        heap[index] = parent
        index = parent_index
      end
      heap[index] = timer
    end

    def pop
      heap = @heap
      last = heap.pop
      return if heap.empty?

      sift_down(last, 0)
    end

    # Places `timer` at `index` or below, keeping the heap ordered.
    def sift_down(timer, index)
      heap = @heap
      size = heap.size
      deadline = timer.deadline
      # (while, not Kernel#loop: a block call per level made sifting a
      # quarter of the loop's time with 2,000 fibers in `sleep`)
      while (child = (index << 1) + 1) < size
        child_timer = heap[child]
        right = child + 1
        if right < size && (right_timer = heap[right]).deadline < child_timer.deadline
          child = right
          child_timer = right_timer
        end
        break if deadline <= child_timer.deadline

        heap[index] = child_timer
        index = child
      end
      heap[index] = timer
    end

    def compact
      live = @heap.reject(&:cancelled?)
      @heap = []
      @cancelled = 0
      live.each { |timer| push(timer) }
    end
  end
end
