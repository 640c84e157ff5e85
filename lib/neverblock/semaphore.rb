# frozen_string_literal: true

module NeverBlock
  # A counting semaphore: at most `limit` holders at once, the others wait
  # in line (first come, first served). Inside NeverBlock a waiter suspends
  # only its fiber; it works across threads too, so one semaphore can bound
  # a whole worker process, but one process only: each forked worker of a
  # server has its own (with `-w 2`, `Semaphore.new(3)` lets 6 run at once;
  # {ServerSemaphore} bounds every process of a machine, {RedisSemaphore} a fleet).
  #
  #   STRIPE = NeverBlock::Semaphore.new(5) # at most 5 calls at once
  #   STRIPE.acquire { Stripe::Charge.retrieve(id) }
  #
  # A waiter that is cancelled or times out leaves the line without taking
  # a place; a holder gives its place back however its block ends.
  class Semaphore
    # @return [Integer] how many may hold it at once.
    attr_reader :limit

    # @param limit [Integer] >= 1.
    # @raise [ArgumentError] otherwise.
    def initialize(limit)
      @limit = NeverBlock.validate_size!(limit, :limit)
      @places = Thread::Queue.new
      limit.times { @places << true }
    end

    # Waits for a place, runs the block holding it, and gives it back.
    # @return [Object] the block's value.
    def acquire
      raise ArgumentError, "Semaphore#acquire needs a block" unless block_given?

      @places.pop
      begin
        yield
      ensure
        @places << true
      end
    end

    # @return [Integer] places free now.
    def available
      @places.size
    end

    # @return [Integer] fibers and threads waiting for a place.
    def waiting
      @places.num_waiting
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} limit=#{@limit} available=#{available} waiting=#{waiting}>"
    end
  end
end
