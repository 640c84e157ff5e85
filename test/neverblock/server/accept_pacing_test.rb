# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/ready_descriptors"

# A backlog of hundreds of connections (a herd of event streams
# reconnecting at once) starts over several turns of the loop, a batch a
# turn, rather than all on one turn: the streams already open get their
# next events between the batches. Taken in whole, 1,000 streams started on
# one 0.3 s turn, and every stream open before them waited that long. While
# the loop's turns are long (its CPU taken by the streams already open),
# fewer start a turn.
class ServerAcceptPacingTest < PlainTest
  include ServerHelper
  include ReadyDescriptors

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

  # The acceptor's pace is told how many streams are open: with 100
  # streamed responses being written and the loop left behind on its
  # descriptors turn after turn (each stream waits on one that stays
  # ready), a backlog past the first batch is held (StartPace's hold) until
  # its connections have waited StartPace::WAIT, and then starts. Without
  # the streams' count the pace would not look at the descriptors, and the
  # backlog would start a batch a turn.
  def test_a_backlog_waits_while_open_streams_leave_the_loop_behind
    NeverBlock.run do
      skip_livelocking_uring
      skip_unless_batched_selector
    end
    stop = false
    pairs = ready_pairs(100)
    streams = Queue.new
    holding = Queue.new
    release = Queue.new
    app = lambda do |env|
      if env["PATH_INFO"] == "/hold"
        holding << true
        Fiber.new(blocking: true) { release.pop }.resume # the loop's thread stops here while the backlog fills
        next [200, { "content-type" => "text/plain" }, ["held"]]
      end
      next [200, { "content-type" => "text/plain" }, ["hello"]] unless env["PATH_INFO"] == "/stream"

      reader = pairs[streams.size].first
      streams << true
      body = Enumerator.new do |out|
        out << "open\n"
        wake_when_ready(reader) until stop # ready at once, every time: the loop is always behind
      end
      [200, { "content-type" => "text/plain" }, body]
    end
    start_server(app, lint: false, adaptive_limit: false)
    2.times do # 50 and 50: fewer than a batch each, all started at once
      opened = Array.new(50) { send_without_waiting(@port, "GET /stream HTTP/1.1\r\nHost: localhost\r\n\r\n") }
      opened.each { |socket| assert_equal "HTTP/1.1 200 OK\r\n", Timeout.timeout(30) { socket.gets("\r\n") } }
    end
    assert_equal 100, @server.stats[:streams_open]

    holder = send_without_waiting(@port, "GET /hold HTTP/1.1\r\nHost: localhost\r\n\r\n")
    holding.pop
    began = NeverBlock::Clock.now
    waiting = Array.new(BACKLOG) { send_without_waiting(@port, "GET /n HTTP/1.1\r\nHost: localhost\r\n\r\n") }
    release << true
    assert_equal "held", read_response(holder, timeout: 30)[2]
    waited = waiting.map do |socket|
      assert_equal "hello", read_response(socket, timeout: 60)[2]
      NeverBlock::Clock.now - began
    end
    held = waited.count { |seconds| seconds >= NeverBlock::Server::StartPace::WAIT * 0.8 }
    assert_operator held, :>=, BACKLOG - (2 * MOST_A_TURN),
                    "connections held while the streams left the loop behind (of #{BACKLOG}; waits #{waited.minmax.map { |s| s.round(2) }})"
  ensure
    stop = true # each stream ends at its next wake-up
    deadline = NeverBlock::Clock.now + 10
    sleep 0.01 while @server && @server.stats[:streams_open].positive? && NeverBlock::Clock.now < deadline
    pairs&.flatten&.each(&:close)
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
