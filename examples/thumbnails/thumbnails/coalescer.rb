# frozen_string_literal: true

module Thumbnails
  # Coalesces identical work in flight: while the block for a key runs, a
  # second caller with the same key does not run it again but waits for the
  # first one's result (or exception). Twenty concurrent requests for one
  # thumbnail make one origin fetch and one resize.
  #
  # The work runs in a task of its own, not in the first caller's fiber: a
  # caller that goes away (its client disconnected, its request was
  # cancelled) does not abort it for the others.
  #
  # The same idea for any Rack app, at the HTTP level and across processes,
  # is NeverBlock::Debouncer (`use NeverBlock::Debouncer`); this one
  # coalesces on the thumbnail itself, whatever the request's URL and
  # headers looked like.
  class Coalescer
    # One key's work in flight. Its waiters block on `done`, a queue that is
    # never pushed to: closing it wakes every one of them at once.
    Flight = Struct.new(:done, :value, :error)
    private_constant :Flight

    def initialize
      @flights = {} # key => Flight
    end

    # Runs the block for `key` unless it is running already; either way,
    # waits (this fiber only) for its result.
    #
    # @param key [String]
    # @return [Array(Object, Boolean)] the block's value, and true when this
    #   call waited for another caller's run.
    # @raise [StandardError] what the block raised, to every caller.
    def call(key, &work)
      flight = @flights[key]
      shared = !flight.nil?
      flight ||= start(key, work)
      flight.done.pop # nil once closed: the run ended
      raise flight.error if flight.error

      [flight.value, shared]
    end

    # @return [Integer] keys in flight now.
    def in_flight
      @flights.size
    end

    private

    def start(key, work)
      flight = @flights[key] = Flight.new(Thread::Queue.new)
      # Detached: every request waiting for the key shares it, so it must not
      # end with the request that started it (a client that hung up, say).
      NeverBlock.spawn(detached: true) do
        flight.value = work.call
      rescue StandardError => e
        flight.error = e # each waiter raises it; nobody else needs to hear of it
      ensure
        flight.error ||= NeverBlock::Cancelled.new("the thumbnail's task ended early") if flight.value.nil?
        @flights.delete(key)
        flight.done.close
      end
      flight
    end
  end
end
