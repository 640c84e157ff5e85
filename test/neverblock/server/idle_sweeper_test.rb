# frozen_string_literal: true

require_relative "server_helper"
require "delegate"

# The IdleSweeper ends keep-alive waits past idle_timeout. Expiring a
# connection lets other fibers run before the sweep ends; these tests make
# another connection's request finish exactly then (its app waits, a loop
# turn at a time, until the idle connection is gone).
class ServerIdleSweeperTest < PlainTest
  include ServerHelper

  IDLE = 0.2

  # The app of /wait returns once the server has `count` connections or fewer.
  def app_waiting_for_connections(count)
    server = nil
    app = lambda do |env|
      if env["PATH_INFO"] == "/wait"
        connections = server.instance_variable_get(:@acceptor).connections
        until connections.size <= count
          # ~1 ms of work per turn: this fiber's sleep(0) timer comes due
          # after the sweeper's, so it runs right after the sweeper's expiry.
          deadline = NeverBlock::Clock.now + 0.001
          nil while NeverBlock::Clock.now < deadline
          sleep 0
        end
      end
      [200, { "content-type" => "text/plain", "content-length" => "2" }, ["ok"]]
    end
    server = start_server(app, lint: false, idle_timeout: IDLE, adaptive_limit: false)
  end

  def request(socket, path)
    socket.write("GET #{path} HTTP/1.1\r\nHost: x\r\n\r\n")
    read_response(socket)
  end

  # Its request ends while the sweeper expires the idle connection: it
  # begins its idle wait then, and must still be closed, not left open
  # until some other connection goes idle.
  def test_a_connection_that_goes_idle_during_a_sweep_is_closed_in_time
    server = app_waiting_for_connections(1)
    idle = connect # sends nothing: idle from the start
    eventually { server.stats[:connections] == 1 } # accepted first: due first
    busy = connect
    assert_equal 200, request(busy, "/wait")[0]
    responded = NeverBlock::Clock.now
    assert_equal "", read_all(busy, timeout: 10 * IDLE), "the connection was left open"
    assert_operator NeverBlock::Clock.now - responded, :<, 10 * IDLE
    assert_equal "", read_all(idle)
  end

  # Its request comes just as its idle_timeout passes, while another
  # request holds the loop: when the loop goes on, the sweep comes due
  # before the loop looks at the idle socket again. A connection with the
  # request's bytes unread must be served, not closed: a close with unread
  # bytes resets it, and the client loses a request it sent in time (seen
  # as ECONNRESET in a herd of 2,000 connections on a loaded machine).
  # The holding request is read by a fiber the selector resumes (its
  # connection waits, not yet parked, when the request comes), so the hold
  # is inside the selector's turn, and the timers (the sweep) fire after it.
  def test_a_request_that_arrives_as_the_idle_timeout_passes_is_served
    idle_timeout = 3.0 # a sweep interval of 0.375 s: time to send before the holder parks, and for the setup
    sent = Thread::Queue.new
    app = lambda do |env|
      # Holds the loop (not the GVL) until the client has sent on `idle`.
      Fiber.new(blocking: true) { sent.pop }.resume if env["PATH_INFO"] == "/hold"
      [200, { "content-type" => "text/plain", "content-length" => "2" }, ["ok"]]
    end
    server = start_server(app, lint: false, idle_timeout: idle_timeout, adaptive_limit: false)
    idle = connect # sends nothing for now
    eventually { server.stats[:connections] == 1 }
    holder = connect
    eventually { server.stats[:connections] == 2 }
    holder.write("GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
    eventually { server.stats[:requests_in_flight] == 1 }
    sleep idle_timeout * 1.5 # past the idle connection's deadline and its sweep slot
    idle.write("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    sent << true
    assert_equal 200, read_response(holder)[0]
    assert_equal 200, read_response(idle)[0], "the request sent in time was lost"
  ensure
    sent&.push(true)
  end
end

# The same with a fiber per idle connection (no IdleSet), where expiring a
# connection's wait lets its fiber run before the sweep goes on.
class ServerIdleSweeperFiberWaitTest < ServerIdleSweeperTest
  include FiberPerIdleConnection

  # Due in the same sweep as another connection, this one is served
  # before the sweeper gets to it: its fresh idle wait must run its full
  # idle_timeout, not end at once (its client may be sending its next
  # request, which would be lost).
  def test_a_connection_served_during_a_sweep_is_not_closed_under_its_next_wait
    go = Thread::Queue.new
    sent = Thread::Queue.new
    server = nil
    app = lambda do |env|
      if env["PATH_INFO"] == "/wait"
        connections = server.instance_variable_get(:@acceptor).connections
        until connections.size < 4 # the sweep has expired the first idle connection
          deadline = NeverBlock::Clock.now + 0.001
          nil while NeverBlock::Clock.now < deadline
          sleep 0
        end
        go << true
        # Holds the loop (not the GVL) until the client has sent on `third`
        # (on loopback the bytes are readable once its write returned).
        Fiber.new(blocking: true) { sent.pop }.resume
      end
      [200, { "content-type" => "text/plain", "content-length" => "2" }, ["ok"]]
    end
    server = start_server(app, lint: false, idle_timeout: IDLE, adaptive_limit: false)
    idle = [connect, connect]
    third = connect # idle from the start, due in the same sweep as the other two
    eventually { server.stats[:connections] == 3 } # all three accepted before the fourth
    waiting = connect
    waiting.write("GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
    go.pop
    third.write("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    sent << true
    assert_equal 200, read_response(third)[0]
    responded = NeverBlock::Clock.now
    assert_equal "", read_all(third)
    assert_operator NeverBlock::Clock.now - responded, :>=, IDLE * 0.8,
                    "closed before its own idle_timeout"
    (idle + [waiting]).each { |socket| read_all(socket) }
  ensure
    sent&.push(true) # a test that failed before it sent must not leave the loop held
  end
end

# With the IdleSet, parked connections whose idle_timeout passed are closed
# in the sweep itself: no fiber runs for them.
class ServerIdleSweeperParkedTest < PlainTest
  include ServerHelper

  IDLE = 0.2

  def setup
    skip "no IdleSet here: #{NeverBlock::Server::IdleSet.missing_reason}" unless NeverBlock::Server::IdleSet.available?
    super
  end

  def test_parked_connections_are_closed_after_idle_timeout_without_a_task
    server = start_server(idle_timeout: IDLE)
    sockets = Array.new(20) { connect }
    sockets.each { |socket| socket.write(get) }
    sockets.each { |socket| assert_equal 200, read_response(socket)[0] }
    completed = nil
    eventually do
      stats = server.stats
      completed = stats[:connection_fibers][:completed]
      stats[:idle_connections] == 20 && stats[:connection_fibers][:busy].zero?
    end
    sockets.each { |socket| assert_equal "", read_all(socket, timeout: 10 * IDLE) }
    eventually { server.stats[:connections].zero? }
    assert_equal completed, server.stats[:connection_fibers][:completed], "a task ran to close a parked connection"
  end

  # The IdleSet's epoll set, its reports held back until `until` (monotonic
  # seconds): the set's queue as a loop with thousands of readable parked
  # sockets has it, a few hundred reported a turn.
  class LateReports < SimpleDelegator
    def initialize(epoll, until_time)
      super(epoll)
      @until = until_time
    end

    def ready
      NeverBlock::Clock.now < @until ? [] : __getobj__.ready
    end
  end

  # A parked connection whose request comes before its idle deadline, but
  # which the IdleSet has not reported by then and for a sweep interval
  # after: the request came in time, and must be served, not reset (10,000
  # streams opened at once lost 7,229 that way).
  def test_a_parked_connection_whose_request_came_in_time_is_served_however_late_the_set_reports_it
    idle_timeout = 1.0 # a sweep interval of 0.125 s
    server = start_server(idle_timeout: idle_timeout)
    idle = connect
    idle_set = nil # made in the server's loop once it runs
    eventually { (idle_set = server.instance_variable_get(:@context).idle_set)&.size == 1 }
    epoll = idle_set.instance_variable_get(:@epoll)
    idle_set.instance_variable_set(:@epoll, LateReports.new(epoll, NeverBlock::Clock.now + (idle_timeout * 3)))
    idle.write(get("/", "Connection: close\r\n"))
    response = read_response(idle)
    assert_equal 200, response[0], "the request sent in time was lost"
  ensure
    idle_set&.instance_variable_set(:@epoll, epoll) if epoll
  end
end
