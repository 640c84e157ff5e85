# frozen_string_literal: true

require_relative "server_helper"

# A response whose head went out before a stop began (a stream, a long body)
# promised keep-alive: it has no `connection: close`. A client that reuses
# its connection the moment the response ends (a proxy with `http-reuse`)
# may have sent its next request before it sees the server close. The stop
# gives such a connection what it gives an idle one: STOP_IDLE_GRACE for a
# request on its way, answered with `connection: close`. Closed at once
# instead, the request was reset unread, and a proxy tells its client
# nothing but EOF (the fleet drill's lost request in a hot restart).
class ServerStopKeepAliveTest < PlainTest
  include ServerHelper

  # A stream that stops the server between its two events, and ends once
  # the stop has begun.
  def stopping_stream
    lambda do |env|
      return [200, { "content-length" => "5" }, ["after"]] if env["PATH_INFO"] == "/after"

      events = Enumerator.new do |stream|
        stream << "data: 1\n\n"
        @server.stop
        sleep 0.01 until @server.stopping?
        stream << "data: 2\n\n"
      end
      [200, { "content-type" => "text/event-stream" }, events]
    end
  end

  def teardown
    super
  ensure
    ENV[NeverBlock::Server::IdleSet::SWITCH] = @idle_set_switch[0] if @idle_set_switch
    replace_constant(NeverBlock::Server, :STOP_IDLE_GRACE, @grace) if @grace
  end

  # A longer grace (STOP_IDLE_GRACE) for a test whose next request must
  # come within it, which a loaded machine's second may not allow; the
  # tests of what happens when the grace runs out keep the real one.
  def long_grace
    @grace = replace_constant(NeverBlock::Server, :STOP_IDLE_GRACE, 10.0)
  end

  # Servers started after it hold idle connections in fibers of their own
  # (no IdleSet), so that a connection cannot be parked meanwhile.
  def without_idle_set
    @idle_set_switch = [ENV.fetch(NeverBlock::Server::IdleSet::SWITCH, nil)]
    ENV[NeverBlock::Server::IdleSet::SWITCH] = "off"
  end

  # A server running #stopping_stream, and a connection that asked for
  # the stream. @return [Socket]
  def stream_requested
    start_server(stopping_stream, lint: false, idle_timeout: 60)
    socket = connect
    socket.write(get("/stream"))
    socket
  end

  # Sends the next request at once, as a proxy reusing the connection
  # does: it is answered, with `connection: close`, and the server stops.
  def assert_next_request_answered_with_close(socket)
    socket.write(get("/after"))
    status, headers, body = read_response(socket)
    assert_equal [200, "close", "after"], [status, headers["connection"], body]
    assert @server_thread.join(10)
  end

  def test_a_request_sent_the_moment_a_stream_ends_during_a_stop_is_answered
    long_grace
    socket = stream_requested
    status, headers, body = read_response(socket)
    assert_equal [200, nil, "data: 1\n\ndata: 2\n\n"], [status, headers["connection"], body]
    assert_next_request_answered_with_close(socket)
  end

  # Plays the drain's pass (Acceptor#drain: close_if_idle) the moment the
  # connection it is prepended to begins a wait in its fiber for its next
  # request, and counts the waits that began with the request there.
  module DrainAtWait
    attr_reader :waits_with_request_there

    private

    def read_when_ready(buffer)
      @waits_with_request_there = (@waits_with_request_there || 0) + (bytes_waiting? ? 1 : 0)
      connection = self
      Fiber.schedule { connection.close_if_idle }
      super
    end
  end

  # The grace's wait ends with the request there: it is read at once. A
  # wait for it in the selector first, idle to the drain, could be ended
  # by it (a drain's pass that did not look for bytes waiting: see the
  # tests below), and the request reset unread.
  def test_a_request_that_came_in_the_grace_is_read_at_once
    long_grace
    socket = stream_requested
    assert_equal 200, read_response(socket)[0]
    connection = server_connection(socket)
    connection.singleton_class.prepend(DrainAtWait)
    assert_next_request_answered_with_close(socket)
    assert_includes [nil, 0], connection.waits_with_request_there, "it waited with the request there"
  end

  # The grace's wait ran out as the request came (its timer and the bytes
  # on one loop turn, or the bytes just after the timer, on a loaded
  # machine): once the server stops, the stub's wait reports nothing when
  # it ends, the request there. The last look before the close finds it. A
  # proxy that puts the host back in its balancer as the grace ends may
  # send it just then (the fleet drill's lost request, once in a CI pass).
  def test_a_request_that_came_as_the_grace_ran_out_is_answered
    long_grace
    start_server(stopping_stream, lint: false, idle_timeout: 60)
    socket = connect
    server = @server
    io = nil
    eventually do
      io = server_connection(socket).instance_variable_get(:@socket)
    rescue Minitest::Assertion # not accepted yet
      nil
    end
    io.singleton_class.prepend(Module.new do
      define_method(:wait_readable) { |*args| super(*args) && (server.stopping? ? nil : self) }
    end)
    socket.write(get("/stream"))
    assert_equal 200, read_response(socket)[0]
    assert_next_request_answered_with_close(socket)
  end

  # The drain's last pass (Acceptor#drain: close_if_idle, as its grace
  # ends) over an idle keep-alive connection whose client has just sent
  # `bytes`, unread yet. Played by an app that holds the loop (a CPU-bound
  # request) until the bytes are there, then makes that pass over the idle
  # connection. `parked`: first wait until the connection is parked in the
  # IdleSet (true) or waits in its fiber (false); nil: either.
  # @return [Array(Socket, Array)] the client's socket, and what the pass
  #   saw: [bytes waiting, parked]
  def drain_pass_after(bytes, parked: nil)
    draining = Queue.new
    idle = nil
    seen = nil
    app = lambda do |env|
      return [200, { "content-length" => "2" }, ["ok"]] unless env["PATH_INFO"] == "/drain"

      draining << true
      deadline = now + 10
      # Holds the loop: the idle connection's bytes stay unread.
      Thread.pass until idle.send(:bytes_waiting?) || now > deadline
      seen = [idle.send(:bytes_waiting?), idle.parked?]
      idle.close_if_idle
      [200, { "content-length" => "7" }, ["drained"]]
    end
    # Waiting in its fiber: the IdleSet would park it 0.5-1 s after a
    # response (the idle sweep), or at once after a request that held its
    # slot past Connection::TURN, as a loaded machine's hello world may.
    without_idle_set if parked == false
    start_server(app, lint: false, idle_timeout: 60)
    client = connect
    client.write(get("/first"))
    assert_equal 200, read_response(client)[0]
    idle = server_connection(client)
    eventually { idle.idle? && (parked.nil? || idle.parked? == parked) }

    drainer = connect
    drainer.write(get("/drain"))
    draining.pop
    client.write(bytes)
    assert_equal 200, read_response(drainer)[0]
    [client, seen]
  end

  # The pass serves a connection whose next request came, rather than
  # reset it unread; once while the connection waits in its fiber, once
  # parked in the IdleSet.
  def assert_drain_pass_serves_request_on_its_way(parked:)
    client, seen = drain_pass_after(get("/second"), parked: parked)
    assert_equal [200, "ok"], read_response(client).values_at(0, 2)
    assert_equal [true, parked], seen, "[the request there, parked] as the pass ran"
  end

  # Bytes that begin no request (an empty line between requests) do not
  # keep a connection open at the drain's last pass.
  def test_the_drains_last_pass_closes_a_connection_whose_bytes_begin_no_request
    client, seen = drain_pass_after("\r\n")
    assert_equal "", read_all(client, within: 5)
    assert_equal true, seen[0], "the bytes were read before the pass"
  end

  def test_the_drains_last_pass_serves_a_request_on_its_way_to_a_waiting_connection
    assert_drain_pass_serves_request_on_its_way(parked: false)
  end

  def test_the_drains_last_pass_serves_a_request_on_its_way_to_a_parked_connection
    skip "no IdleSet here (#{NeverBlock::Server::IdleSet.missing_reason})" unless NeverBlock::Server::IdleSet.available?
    assert_drain_pass_serves_request_on_its_way(parked: true)
  end

  def test_a_stream_that_ends_during_a_stop_closes_its_connection_after_the_grace
    socket = stream_requested
    assert_equal 200, read_response(socket)[0]

    assert_equal "", read_all(socket, timeout: 5) # not idle_timeout (60 s) nor shutdown_timeout (30 s)
    assert @server_thread.join(5)
  end
end
