# frozen_string_literal: true

require_relative "server_helper"

# A keep-alive connection whose request held its slot for Connection::TURN or
# longer waits its turn for the next request parked in the IdleSet (so that
# connections are served in the order their requests arrive), but in its own
# fiber (Parking#wait_turn): its next request is served by the same task, not
# a new one. Each way that wait can end: the request comes, the client goes
# idle (the IdleSweeper settles it: the fiber is given up), the idle timeout,
# a stop, a cancelled task, and more fiber waits than IdleSet::WAITING_FIBERS
# (it then parks without its fiber, as before).
class ServerTurnWaitTest < PlainTest
  include ServerHelper

  # /slow holds its request slot 20 ms, past Connection::TURN (1 ms). Every
  # response's body is the task that served it.
  APP = lambda do |env|
    sleep 0.02 if env["PATH_INFO"] == "/slow"
    [200, { "content-type" => "text/plain" }, [NeverBlock::Task.current.object_id.to_s]]
  end

  def setup
    skip "no IdleSet here (neverblock/epoll not built)" unless NeverBlock::Server::IdleSet.available?
    super
  end

  def teardown
    super
  ensure
    @handoff_pairs&.each { |pair| pair&.each { |socket| socket.close unless socket.closed? } }
  end

  def test_the_request_after_a_turn_is_served_by_the_same_task
    start_unsettled_server(APP)
    socket = connect
    first = served_by(socket, "/slow")
    assert_equal first, served_by(socket, "/"), "the request after /slow came to another task"
    assert_equal first, served_by(socket, "/slow")
    assert_equal first, served_by(socket, "/slow")
    assert_equal first, served_by(socket, "/")
  end

  def test_a_connection_idle_after_its_turn_gives_its_fiber_up
    start_server(APP, idle_timeout: 3600)
    wait_serving
    base = server_tasks
    socket = connect
    first = served_by(socket, "/slow")
    # The IdleSweeper settles it a sweep interval (0.5 s) later.
    eventually(timeout: 10) { server_tasks == base && idle_set.fiber_waits.zero? }
    assert_equal 1, idle_set.size, "no longer parked"
    refute_equal first, served_by(socket, "/"), "served without a new task"
    assert_equal 1, @server.stats[:connections]
  end

  # The IdleSweeper settles a connection a sweep interval into its wait
  # (here 0.125 s), before its idle timeout (1 s); here a task of the app's
  # holds the loop from 30 ms after the response, the connection waiting
  # its turn in its fiber, past both, and the sweeper then finds the
  # deadline passed first: it closes the connection while its fiber still
  # waits there.
  def test_the_idle_timeout_closes_a_connection_waiting_its_turn
    app = lambda do |env|
      if env["PATH_INFO"] == "/slow-then-hold-the-loop"
        NeverBlock.spawn(detached: true) do # (a child would end with the request)
          sleep 0.05 # (/slow answers after 20 ms)
          held_since = Process.clock_gettime(Process::CLOCK_MONOTONIC)
          nil while Process.clock_gettime(Process::CLOCK_MONOTONIC) - held_since < 1.5
        end
      end
      APP.call(env.merge("PATH_INFO" => "/slow"))
    end
    start_server(app, idle_timeout: 1)
    wait_serving
    base = server_tasks
    socket = connect
    served_by(socket, "/slow-then-hold-the-loop")
    assert socket.wait_readable(10), "not closed"
    assert_nil socket.read_nonblock(1, exception: false)
    eventually(timeout: 10) { server_tasks == base && @server.stats[:connections].zero? }
    assert_equal 0, idle_set.size
  end

  # A stop closes a parked connection once its grace for idle connections
  # (Server::STOP_IDLE_GRACE, here none, so that the IdleSweeper does not
  # settle it meanwhile) is over; if that close did not end the fiber's
  # wait, the stop would wait for its task (up to shutdown_timeout).
  def test_a_stop_closes_a_connection_waiting_its_turn_at_once
    with_constant(NeverBlock::Server, :STOP_IDLE_GRACE, 0.0) do
      start_unsettled_server(APP, idle_timeout: 3600, shutdown_timeout: 60)
      wait_serving
      base = server_tasks
      socket = connect
      served_by(socket, "/slow")
      assert_equal base + 1, server_tasks, "its fiber did not wait there"
      started = now
      @server.stop
      assert @server_thread.join(20), "the stop waited for the fiber"
      assert_operator now - started, :<, 20
      assert socket.wait_readable(10)
      assert_nil socket.read_nonblock(1, exception: false)
    end
  end

  # Its task cancelled while it waits (here by the app; on a stop, the pool
  # cancels what is left), the connection stays parked without a fiber, as
  # a connection parked for its turn was before, and a new task serves it.
  def test_a_connection_whose_turn_wait_is_cancelled_is_served_by_a_new_task
    server = nil
    app = lambda do |env|
      if env["PATH_INFO"] == "/cancel"
        waiting = server.instance_variable_get(:@acceptor).instance_variable_get(:@connections).keys
                        .select { |connection| connection.instance_variable_get(:@turn_fiber) }
        waiting.each { |connection| connection.task.cancel }
        next [200, { "content-type" => "text/plain" }, [waiting.size.to_s]]
      end
      APP.call(env)
    end
    server = start_unsettled_server(app, idle_timeout: 3600)
    waiting = connect
    first = served_by(waiting, "/slow")
    other = connect
    other.write(get("/cancel"))
    assert_equal [200, "1"], read_response(other).values_at(0, 2)
    eventually(timeout: 10) { idle_set.fiber_waits <= 1 } # (the other connection's own)
    assert_equal 200, (response = request(waiting, "/"))[0]
    refute_equal first, response[2]
  end

  def test_beyond_the_fiber_waits_a_turn_is_waited_without_the_fiber
    start_server(APP, idle_timeout: 3600)
    wait_serving
    idle_set.instance_variable_set(:@waiting_fibers, 0)
    socket = connect
    first = served_by(socket, "/slow")
    refute_equal first, served_by(socket, "/")
  end

  # A connection waiting its turn in its fiber whose next request a less
  # busy sibling worker takes over (Handoff, from Acceptor#wake_parked):
  # the socket is the sibling's, with the request unread, and the fiber
  # that waited here ends (Connection#wake_turn after the close). Left
  # suspended, it would hold a task and a fiber wait until a stop, which
  # would then wait shutdown_timeout for it.
  def test_a_connection_handed_to_a_sibling_while_its_fiber_waits_leaves_no_task_behind
    sibling = start_server_beside_a_sibling
    base = server_tasks
    moving = connect
    staying = connect
    served_by(moving, "/slow")
    stayed = served_by(staying, "/slow")
    assert_equal base + 2, server_tasks, "their fibers did not wait there"
    assert_equal 2, idle_set.fiber_waits
    moving.write(get("/moved"))
    answer_moved(sibling, moving)
    assert_equal 1, @server.stats[:handed_off]
    eventually(timeout: 10) { server_tasks == base + 1 && idle_set.fiber_waits == 1 }
    assert_equal 1, @server.stats[:connections]
    assert_equal stayed, served_by(staying, "/"), "the connection that stayed lost its fiber"
  end

  # The same beyond IdleSet::WAITING_FIBERS, where the connection waits its
  # turn without a fiber: no task starts here for the connection that left.
  def test_no_task_starts_for_a_connection_handed_to_a_sibling_from_a_turn_wait_without_its_fiber
    sibling = start_server_beside_a_sibling
    idle_set.instance_variable_set(:@waiting_fibers, 0)
    moving = connect
    staying = connect
    served_by(moving, "/slow")
    served_by(staying, "/slow")
    connection = server_connection(moving)
    parked_by = connection.task
    refute connection.fiber, "it waited its turn in its fiber"
    moving.write(get("/moved"))
    answer_moved(sibling, moving)
    assert_equal 1, @server.stats[:handed_off]
    served_by(staying, "/") # (the server's loop is past the move)
    assert_same parked_by, connection.task, "a task started for the connection handed to the sibling"
    assert_equal 1, @server.stats[:connections]
  end

  # A failure as the IdleSet's report is handled (Acceptor#wake_parked;
  # here the hand-off check raises) closes the connection, and the fiber
  # that waited its turn there ends with it: left suspended, it would hold
  # a task until a stop, which would then wait shutdown_timeout for it.
  def test_a_failure_waking_a_connection_ends_the_fiber_that_waited_its_turn
    start_unsettled_server(APP, idle_timeout: 3600, shutdown_timeout: 60)
    wait_serving
    base = server_tasks
    @server.instance_variable_get(:@context).define_singleton_method(:hand_off) { |*| raise IOError, "the test's failure" }
    socket = connect
    served_by(socket, "/slow")
    socket.write(get("/"))
    assert socket.wait_readable(10), "not closed"
    begin
      assert_nil socket.read_nonblock(1, exception: false)
    rescue Errno::ECONNRESET
      nil # (closed with the request unread)
    end
    eventually(timeout: 10) { server_tasks == base && idle_set.fiber_waits.zero? && @server.stats[:connections].zero? }
  end

  private

  # The server with a sweep interval of a minute (#unsettled).
  def start_unsettled_server(app, **options)
    unsettled { start_server(app, **options) }
  end

  # Makes the server the block makes sweep once a minute: its IdleSweeper
  # settles no connection waiting its turn (which would give its fiber up,
  # and no longer count as active) meanwhile, however slowly a loaded
  # machine runs the test.
  # @return what the block returns.
  def unsettled(&)
    with_constant(NeverBlock::Server::IdleSweeper, :MAX_INTERVAL, 60.0, &)
  end

  # Starts the server as worker 0 of a Handoff whose worker 1 is the test:
  # it serves no connection, so the server (two or more active connections,
  # Handoff::MARGIN) hands it the next connection that waited its turn.
  # No connection is settled meanwhile (#unsettled).
  # @return [NeverBlock::Server::Handoff] worker 1's.
  def start_server_beside_a_sibling
    handoff_class = NeverBlock::Server::Handoff
    skip "no handoff here: it needs IO::Buffer.map and SCM_RIGHTS" unless handoff_class.available?

    handoff = handoff_class.new(2)
    @handoff_pairs = handoff.instance_variable_get(:@pairs)
    sibling = handoff.dup
    assert sibling.attach(1, [:listener], -> { 0 })
    sibling.open
    @server = unsettled do
      NeverBlock::Server.new(Rack::Lint.new(APP), bind: ["tcp://127.0.0.1:0"], workers: 0, idle_timeout: 3600, shutdown_timeout: 2)
    end
    @server.worker_index = 0
    @server.handoff = handoff.dup
    @port = Integer(@server.bound_addresses.first[/\d+\z/])
    @server_thread = Thread.new { @server.run }
    wait_serving
    sibling
  end

  # The sibling takes the socket that moved, with `client`'s request
  # unread in it, and answers.
  def answer_moved(sibling, client)
    deadline = now + 10
    received = nil
    until (received = sibling.receive)
      flunk "no connection was handed to the sibling" if now > deadline
      sleep 0.01
    end
    socket = received.first
    (@sockets ||= []) << socket
    assert_equal get("/moved"), socket.readpartial(1000)
    socket.write("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nmoved")
    assert_equal [200, "moved"], read_response(client).values_at(0, 2)
  end

  # @return [String] the task that served `path` on `socket`.
  def served_by(socket, path)
    status, _headers, body = request(socket, path)
    assert_equal 200, status
    body
  end

  def idle_set
    @server.instance_variable_get(:@context).idle_set
  end
end
