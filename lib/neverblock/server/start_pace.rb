# frozen_string_literal: true

module NeverBlock
  class Server
    # How many connections of a backlog the {Acceptor} starts on the loop's
    # next turn: {BATCH} while turns are short, fewer as they grow longer
    # than {TURN}, in proportion, and at least {LEAST}. A turn is everything
    # the loop ran between two of the acceptor's looks: the connections it
    # started last time, and the streams and requests already open. Streams
    # opened together would otherwise all be let in while the loop has no
    # CPU for their events: 2,000 streams of 20 events a second ask 40,000
    # writes a second, more than one core makes, and every open stream's
    # events then wait for turns that grow with each batch started (worst gap
    # p99 491 ms). Letting the backlog wait while turns are long keeps the
    # streams already open on time, and those waiting start as others end;
    # the loop stays busy meanwhile, so no throughput is lost. A backlog of
    # short requests has short turns and is let in {BATCH} a turn, as
    # before.
    class StartPace
      # Connections started a turn while turns take at most {TURN}.
      BATCH = 64

      # Seconds a turn may take before fewer start (a quarter of the
      # {StallDetector}'s default threshold: an event stream's next event is
      # due within a few of its 50 ms intervals).
      TURN = 0.025

      # Connections started a turn however long turns are: a turn made long
      # by something else (a major GC, a request that computes) slows a
      # herd's start, but does not stall it.
      LEAST = 8

      # @param batch [Integer] see {BATCH}.
      # @param turn [Float] see {TURN}.
      # @param least [Integer] see {LEAST}.
      def initialize(batch: BATCH, turn: TURN, least: LEAST)
        @batch = batch
        @turn = turn
        @least = least
      end

      # @param took [Float] seconds the loop's last turn took.
      # @return [Integer] how many to start now: {LEAST} to {BATCH}.
      def after(took)
        return @batch if took <= @turn

        (@batch * @turn / took).floor.clamp(@least, @batch)
      end
    end
  end
end
