# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/serve_processes"
require "json"

# Connections waiting in the kernel's backlog are let in promptly while the
# keep-alive connections already accepted keep the loop busy: they are not
# served only once the busy ones pause. (Found with wrk at 200 connections:
# the server accepted one connection per turn of the loop, 15 a second, and
# wrk's 2 s timeouts hit the connections left in the backlog.)
class ServerAcceptFairnessTest < PlainTest
  include ServerHelper
  include ServeProcesses

  REQUEST = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"

  # Keep-alive clients, each sending its next request as soon as the last is
  # answered, until #stop_hammering; returns once each had an answer.
  def hammer(port, clients)
    @hammering = true
    answered = Queue.new
    @answers = Array.new(clients, 0) # per client: no two threads write one element
    @hammers = Array.new(clients) do |index|
      socket = TCPSocket.new("127.0.0.1", port)
      (@sockets ||= []) << socket
      Thread.new do
        while @hammering
          socket.write(REQUEST)
          read_response(socket, timeout: 30)
          answered << true if @answers[index].zero?
          @answers[index] += 1
        end
      rescue IOError, SystemCallError
        nil # #stop_hammering closed its socket
      end
    end
    clients.times { Timeout.timeout(30) { answered.pop } }
  end

  def stop_hammering
    @hammering = false
    @sockets&.each { |socket| socket.close unless socket.closed? }
    @hammers&.each { |thread| thread.join(10) }
  end

  def teardown
    stop_hammering
    super
  end

  # Answers the hammering clients had while the block ran: turns of the
  # loop, whatever the machine's load (a turn answers each of them once).
  def hammered_during
    before = @answers.sum
    yield
    @answers.sum - before
  end

  # Fewer answers than this to the 64 hammering clients (16 turns) while 40
  # connections are taken in: "a few turns". One a turn would take 40.
  FEW_TURNS = 16 * 64

  # The fewest answers over up to `attempts` runs of the block (each a
  # measurement of its own), stopping at the first under FEW_TURNS: at load
  # 9-10 the test's own threads can be stalled through one run, but a server
  # that takes connections in one a turn is over in every run.
  def fewest_answers(attempts: 3)
    counts = []
    attempts.times do
      counts << yield
      break if counts.last < FEW_TURNS
    end
    counts.min
  end

  # Opens `count` new connections, each sending a request, and reads their
  # answers (ServerHelper#send_without_waiting: the hammering threads do not
  # spread the connections over many turns).
  def first_answers(port, count, timeout: 30)
    sockets = Array.new(count) { send_without_waiting(port, REQUEST) }
    assert_equal [200] * count, sockets.map { |socket| read_response(socket, timeout: timeout)[0] }
  end

  # Requests that never yield (2 ms of CPU each) from 64 keep-alive clients:
  # a turn of the loop answers each of them once. Taken in one a turn, 40
  # new connections would wait 40 turns (2,560 answers to the others) for
  # the last; taken in together, a few. Counted in answers, not seconds, so
  # the machine's load does not decide it.
  def test_connections_in_the_backlog_are_taken_in_together_while_cpu_bound_requests_keep_the_loop_busy
    assert_backlog_taken_in_within_a_few_turns(workers: 0)
  end

  # The same beside another worker of the listener, where each worker lets
  # the first connection it takes in run before it takes in more (a turn):
  # a few turns, not one per connection.
  def test_connections_in_the_backlog_are_taken_in_within_a_few_turns_beside_another_worker
    assert_backlog_taken_in_within_a_few_turns(workers: 2)
  end

  # 64 keep-alive clients of 2 ms requests keep `workers` busy while 40 new
  # connections wait in the backlog.
  def assert_backlog_taken_in_within_a_few_turns(workers:)
    server = serve("busy.ru", "-w", workers.to_s, env: { "BUSY_MS" => "2" })
    hammer(server[:port], 64)
    others = fewest_answers { hammered_during { first_answers(server[:port], 40) } }
    assert_operator others, :<, FEW_TURNS, "40 new connections waited while the others had #{others} answers"
  end

  # The same for parked idle keep-alive connections (no fiber each, in the
  # worker's IdleSet) that send their next requests at once: they are taken
  # up together, not one a turn.
  def test_parked_connections_that_become_readable_together_are_taken_up_together
    skip "no IdleSet here: #{NeverBlock::Server::IdleSet.missing_reason}" unless NeverBlock::Server::IdleSet.available?

    server = serve("busy.ru", "-w", "0", "--status", "/status", env: { "BUSY_MS" => "2" })
    others = fewest_answers do
      stop_hammering # each run parks 40 fresh connections first, with nothing else open
      idle = Array.new(40) { TCPSocket.new("127.0.0.1", server[:port]) }
      (@sockets ||= []).concat(idle)
      idle.each { |socket| socket.write(REQUEST) }
      assert_equal [200] * 40, idle.map { |socket| read_response(socket)[0] }
      eventually { JSON.parse(get(server, "/status").body).fetch("connection_fibers").fetch("busy") <= 1 } # parked (the status request's own)
      hammer(server[:port], 64)
      hammered_during do
        idle.each { |socket| socket.write(REQUEST) }
        assert_equal [200] * 40, idle.map { |socket| read_response(socket, timeout: 30)[0] }
      end
    end
    assert_operator others, :<, FEW_TURNS, "40 parked connections waited while the others had #{others} answers"
  end

  # Every request slot taken (fiber_pool 2, no adaptive limit) by IO-bound
  # requests from 6 keep-alive clients, whose next requests always wait for
  # one: a released slot goes to a waiting request, never to "free". A new
  # connection is still accepted within a turn of that queue (~150 ms),
  # instead of when no request happens to be waiting.
  def test_a_new_connection_gets_a_turn_while_keep_alive_requests_wait_for_every_slot
    start_server(->(_env) { sleep 0.05; [200, { "content-length" => "2" }, ["ok"]] },
                 fiber_pool: 2, adaptive_limit: false, idle_timeout: 60)
    hammer(@port, 6)
    eventually { @server.stats[:fiber_pool][:queued].positive? }
    seconds = elapsed { first_answers(@port, 1, timeout: 10) }
    assert_operator seconds, :<, 3, "the new connection waited #{seconds.round(2)} s"
  end
end
