# frozen_string_literal: true

module NeverBlockBench
  # A binary min-heap of timers, ordered by deadline (seconds on the monotonic
  # clock) and then by insertion, so timers with equal deadlines fire in the
  # order they were added.
  #
  # Timers are not cancellable; the owner of a timer checks, when it fires,
  # whether it still matters. That keeps every operation O(log n) with no
  # index bookkeeping.
  class TimerHeap
    def initialize
      @entries = [] # [deadline, sequence, payload]
      @sequence = 0
    end

    # @return [Integer] number of pending timers
    def size
      @entries.size
    end

    def empty?
      @entries.empty?
    end

    # Adds a timer.
    #
    # @param deadline [Float] monotonic clock time, seconds
    # @param payload [Object] returned by {#pop_due} when the timer fires
    # @return [void]
    def push(deadline, payload)
      @entries << [deadline, @sequence += 1, payload]
      sift_up(@entries.size - 1)
    end

    # @return [Float, nil] the earliest deadline, or nil when empty
    def next_deadline
      @entries.first&.first
    end

    # Removes every timer whose deadline is at or before `now` and yields its
    # payload, earliest first.
    #
    # @param now [Float] monotonic clock time, seconds
    # @yieldparam payload [Object]
    # @return [void]
    def pop_due(now)
      while (top = @entries.first) && top[0] <= now
        last = @entries.pop
        unless @entries.empty?
          @entries[0] = last
          sift_down(0)
        end
        yield top[2]
      end
    end

    private

    def sift_up(index)
      entry = @entries[index]
      while index.positive?
        parent = (index - 1) / 2
        break unless earlier?(entry, @entries[parent])

        @entries[index] = @entries[parent]
        index = parent
      end
      @entries[index] = entry
    end

    def sift_down(index)
      entry = @entries[index]
      size = @entries.size
      loop do
        child = (2 * index) + 1
        break if child >= size

        child += 1 if child + 1 < size && earlier?(@entries[child + 1], @entries[child])
        break unless earlier?(@entries[child], entry)

        @entries[index] = @entries[child]
        index = child
      end
      @entries[index] = entry
    end

    def earlier?(a, b)
      a[0] < b[0] || (a[0] == b[0] && a[1] < b[1])
    end
  end
end
