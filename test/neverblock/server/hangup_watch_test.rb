# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"

# HangupWatch#look on its own: connections it has seen since a look before,
# and a look at thousands of them (open streams) that lets the loop run
# between slices of peeks.
class ServerHangupWatchTest < PlainTest
  # Stands for a Connection: whether its client is gone, and whether the watch cancelled it.
  class Watched
    attr_reader :cancelled

    def initialize(gone)
      @gone = gone
      @cancelled = false
    end

    def client_gone?
      @gone
    end

    def cancel_for_hangup
      @cancelled = true
    end
  end

  def test_a_look_cancels_the_gone_among_those_watched_since_the_look_before
    watch = NeverBlock::Server::HangupWatch.new
    old = [Watched.new(true), Watched.new(false)]
    old.each { |connection| watch.watch(connection) }
    assert_equal 0, NeverBlock.run { watch.look }, "none was watched before a look yet"
    new = Watched.new(true)
    watch.watch(new)
    assert_equal 1, NeverBlock.run { watch.look }
    assert_equal [true, false, false], [*old, new].map(&:cancelled)
    assert_equal 2, watch.size
  end

  def test_a_look_at_thousands_lets_other_fibers_run_between_its_slices
    watch = NeverBlock::Server::HangupWatch.new
    connections = Array.new(1000) { |index| Watched.new(index.even?) }
    turns = nil
    cancelled = NeverBlock.run do
      connections.each { |connection| watch.watch(connection) }
      watch.look
      ran = 0
      looking = true
      other = NeverBlock.spawn do
        while looking
          ran += 1
          Fiber.scheduler.yield
        end
      end
      gone = watch.look
      turns = ran
      looking = false
      other.wait
      gone
    end
    assert_equal 500, cancelled
    assert(connections.each_with_index.all? { |connection, index| connection.cancelled == index.even? })
    assert_operator turns, :>=, 3, "another fiber ran between the look's slices (HangupWatch::SLICE peeks each)"
  end
end
