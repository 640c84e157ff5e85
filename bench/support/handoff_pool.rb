# frozen_string_literal: true

module NeverBlockBench
  # A small fair pool of connections for code that runs under any fiber
  # scheduler (here: Falcon's, on async) or in threads: at most `size`
  # connections, created on demand; a caller that finds none free waits in
  # line, and a connection given back goes straight to the caller that has
  # waited longest (FIFO handoff, so a newcomer cannot overtake).
  #
  # It waits on a Thread::Queue per waiter, which suspends only the calling
  # fiber under a fiber scheduler (Queue#pop goes through the scheduler's
  # block/unblock hooks since Ruby 3.0) and blocks the thread otherwise.
  #
  #   pool = HandoffPool.new(size: 64) { PG.connect(**conninfo) }
  #   pool.with { |conn| conn.exec("select pg_sleep(0.01)") }
  class HandoffPool
    # @param size [Integer] connections at most
    # @yieldreturn [Object] a new connection
    def initialize(size:, &create)
      @size = size
      @create = create
      @idle = []
      @waiters = []
      @created = 0
      @lock = Thread::Mutex.new
    end

    # Lends a connection to the block. A connection whose block raised is
    # given back too (the benchmark's queries do not leave it dirty).
    # @yieldparam connection [Object]
    # @return [Object] the block's value
    def with
      connection = checkout
      yield connection
    ensure
      checkin(connection) if connection
    end

    private

    def checkout
      waiter = nil
      @lock.synchronize do
        return @idle.pop unless @idle.empty?

        if @created < @size
          @created += 1
        else
          waiter = Thread::Queue.new
          @waiters << waiter
        end
      end
      waiter ? waiter.pop : create
    end

    def create
      @create.call
    rescue StandardError
      @lock.synchronize { @created -= 1 }
      raise
    end

    def checkin(connection)
      @lock.synchronize do
        waiter = @waiters.shift
        waiter ? waiter.push(connection) : @idle.push(connection)
      end
    end
  end
end
