# frozen_string_literal: true

module NeverBlock
  # The engine behind {NeverBlock.map}: feeds items to at most `concurrency`
  # tasks, consuming the enumerable only as slots free up (so a huge or lazy
  # enumerable is not materialised), and collects results by index.
  # @api private
  class Mapper
    def initialize(scheduler, concurrency, block)
      @scheduler = scheduler
      @concurrency = concurrency
      @block = block
      @live = {} # index => running task
      @failure = nil
      @caller = nil
      @waiting = false # the caller is in #wait_until
    end

    # @return [Array] results in input order.
    # @raise [Exception] the first exception a block raised.
    def call(enumerable)
      @caller = Fiber.current
      results = []
      enumerable.each_with_index do |item, index|
        wait_until { @live.size < @concurrency || @failure }
        break if @failure

        start(item, index, results)
      end
      wait_until { @live.empty? || @failure }
      raise @failure if @failure

      results
    ensure
      shut_down
    end

    private

    def start(item, index, results)
      task = @scheduler.spawn(observed: true) do
        results[index] = @block.call(item)
      rescue Exception => e # rubocop:disable Lint/RescueException -- handed to the caller of map
        @failure ||= e
        raise
      ensure
        @live.delete(index)
        # only while the caller waits here: a wake-up elsewhere (say, a
        # sleep in the enumerable's #each) would end that wait early
        @scheduler.wake(@caller) if @waiting
      end
      # spawn ran the block up to its first wait; it may be done already
      @live[index] = task if task.alive?
    end

    def wait_until(&condition)
      @waiting = true
      @scheduler.wait_until(&condition)
    ensure
      @waiting = false
    end

    # On failure or when the caller itself is cancelled: stop the rest.
    def shut_down
      tasks = @live.values
      tasks.each(&:cancel)
      tasks.each(&:wait)
    end
  end
end
