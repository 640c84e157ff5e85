# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/serve_processes"

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
    @hammers = Array.new(clients) do
      socket = TCPSocket.new("127.0.0.1", port)
      (@sockets ||= []) << socket
      Thread.new do
        first = true
        while @hammering
          socket.write(REQUEST)
          read_response(socket, timeout: 30)
          answered << true if first
          first = false
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

  # Seconds until every one of `count` new connections had its first answer.
  def first_answers(port, count, timeout: 30)
    elapsed do
      sockets = Array.new(count) { TCPSocket.new("127.0.0.1", port).tap { |socket| socket.write(REQUEST) } }
      (@sockets ||= []).concat(sockets)
      assert_equal [200] * count, sockets.map { |socket| read_response(socket, timeout: timeout)[0] }
    end
  end

  # Requests that never yield (2 ms of CPU each) from 64 keep-alive clients:
  # a turn of the loop answers up to 64 of them (~130 ms). Taken in one a
  # turn, 30 new connections would wait ~4 s for the last; taken in together
  # they wait about one turn.
  def test_connections_in_the_backlog_are_taken_in_together_while_cpu_bound_requests_keep_the_loop_busy
    server = serve("busy.ru", "-w", "0", env: { "BUSY_MS" => "2" })
    hammer(server[:port], 64)
    seconds = first_answers(server[:port], 30)
    assert_operator seconds, :<, 1.5, "30 new connections waited #{seconds.round(2)} s for their first answers"
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
    seconds = first_answers(@port, 1, timeout: 10)
    assert_operator seconds, :<, 3, "the new connection waited #{seconds.round(2)} s"
  end
end
