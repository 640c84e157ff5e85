# frozen_string_literal: true

require_relative "server_helper"

# A backlog of hundreds of connections (a herd of event streams
# reconnecting at once) starts over several turns of the loop, a batch a
# turn, rather than all on one turn: the streams already open get their
# next events between the batches. Taken in whole, 1,000 streams started on
# one 0.3 s turn, and every stream open before them waited that long. While
# the loop's turns are long (its CPU taken by the streams already open),
# fewer start a turn.
class ServerAcceptPacingTest < PlainTest
  include ServerHelper

  BACKLOG = 300
  MOST_A_TURN = 64 # Acceptor::BATCH

  def test_a_backlog_of_connections_starts_a_batch_a_turn
    turns = turns_of_a_backlog(work_a_turn: 0)
    busiest, started = turns.tally.max_by { |_, count| count }
    assert_operator started, :<=, MOST_A_TURN,
                    "#{started} of the #{BACKLOG} waiting connections started on one turn (turn #{busiest})"
    assert_operator turns.uniq.size, :>=, BACKLOG / MOST_A_TURN
  end

  # Turns of 60 ms (a quarter of a second's CPU for the streams already
  # open, say): fewer start a turn, so that the loop's turns do not grow
  # further with each batch (StartPace: 64 while turns take 25 ms at most).
  # The first batch starts before the acceptor has timed a turn.
  def test_fewer_start_a_turn_while_turns_are_long
    turns = turns_of_a_backlog(work_a_turn: 0.06)
    counts = turns.tally.values.sort.reverse
    assert_operator counts.drop(1).max, :<=, MOST_A_TURN / 2,
                    "after the first batch, #{counts.drop(1).max} started on one 60 ms turn: #{counts.inspect}"
    assert_operator turns.uniq.size, :>=, 1 + ((BACKLOG - MOST_A_TURN) / (MOST_A_TURN / 2))
  end

  private

  # Holds the loop while BACKLOG connections queue, then lets them in, a
  # task computing `work_a_turn` seconds on every turn meanwhile: the turn
  # on which each was answered.
  def turns_of_a_backlog(work_a_turn:)
    turn = 0
    held = Queue.new
    release = Queue.new
    app = lambda do |env|
      if env["PATH_INFO"] == "/hold"
        # Counts the loop's turns from here on: a task that yields once a turn.
        NeverBlock.spawn(detached: true) do
          scheduler = NeverBlock.current_scheduler!
          loop do
            turn += 1
            busy_until = NeverBlock::Clock.now + work_a_turn
            nil while NeverBlock::Clock.now < busy_until
            scheduler.yield
          end
        end
        held << true
        Fiber.new(blocking: true) { release.pop }.resume # the loop's thread stops here while the backlog fills
        return [200, { "content-type" => "text/plain" }, ["held"]]
      end
      [200, { "content-type" => "text/plain" }, [turn.to_s]]
    end
    start_server(app, adaptive_limit: false)
    holder = send_without_waiting(@port, "GET /hold HTTP/1.1\r\nHost: localhost\r\n\r\n")
    held.pop
    waiting = Array.new(BACKLOG) { send_without_waiting(@port, "GET /n HTTP/1.1\r\nHost: localhost\r\n\r\n") }
    release << true
    assert_equal "held", read_response(holder, timeout: 30)[2]

    waiting.map { |socket| Integer(read_response(socket, timeout: 60)[2]) }
  end
end
