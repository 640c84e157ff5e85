# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/certificates"
require_relative "../../support/serve_processes"
require "fileutils"
require "tmpdir"

# Idle keep-alive connections as the server holds them: parked in its
# IdleSet, with no fiber (ServerIdleSetTest), and each in a fiber of its own
# when the IdleSet is off (ServerIdleFiberTest: without the C extension).
# Both must serve, time out, stop and clean up the same.
module IdleConnectionBehaviour
  include ServerHelper

  # Waits until `count` connections are idle, and (with the IdleSet) parked:
  # the IdleSweeper parks a connection that waited one sweep interval.
  def wait_idle(count)
    eventually { @server.stats[:idle_connections] == count }
    eventually { @server.stats[:connection_fibers][:busy].zero? } if parks?
  end

  # `count` new connections, each answered once and then idle (#wait_idle).
  def idle_connections(count)
    sockets = Array.new(count) { connect }
    sockets.each { |socket| assert_equal 200, request(socket)[0] }
    wait_idle(count)
    sockets
  end

  def test_idle_connections_are_served_again_after_an_idle_period
    start_server(lint: false)
    sockets = Array.new(500) { connect }
    sockets.each { |socket| socket.write(get) }
    sockets.each { |socket| assert_equal 200, read_response(socket)[0] }
    wait_idle(500)
    sockets.each { |socket| socket.write(get("/again")) }
    sockets.each { |socket| assert_equal [200, "hello\n"], read_response(socket).values_at(0, 2) }
    assert_equal 500, @server.stats[:connections]
  end

  def test_the_idle_timeout_closes_idle_connections
    start_server(idle_timeout: 0.2)
    sockets = Array.new(10) { connect }
    sockets.each { |socket| assert_equal 200, request(socket)[0] }
    sockets.each { |socket| assert_equal "", read_all(socket, timeout: 5) }
    eventually { @server.stats[:connections].zero? }
  end

  def test_stop_closes_idle_connections_and_lets_requests_in_flight_finish
    release = Thread::Queue.new
    app = lambda do |env|
      release.pop if env["PATH_INFO"] == "/slow"
      [200, { "content-length" => "2" }, ["ok"]]
    end
    start_server(app, lint: false)
    idle = idle_connections(20)
    busy = connect
    busy.write(get("/slow"))
    eventually { @server.stats[:requests_in_flight] == 1 }
    stopper = Thread.new { @server.stop }
    idle.each { |socket| assert_equal "", read_all(socket, timeout: 10) }
    release << true
    status, headers, body = read_response(busy)
    assert_equal [200, "ok", "close"], [status, body, headers["connection"]]
    assert @server_thread.join(20), "the server did not stop"
    stopper.join
  end

  def test_a_client_that_closes_while_idle_leaves_no_descriptor_behind
    start_server
    wait_serving
    before = fd_count
    sockets = idle_connections(50)
    sockets.each(&:close)
    @sockets.clear
    eventually { @server.stats[:connections].zero? }
    eventually { fd_count <= before } # theirs and the server's ends of them
  end

  def test_requests_pipelined_behind_a_response_are_served
    start_server
    socket = connect
    socket.write(get("/1") + get("/2") + get("/3"))
    3.times { assert_equal 200, read_response(socket)[0] }
    # Part of a next request read with the one before: its connection is not
    # idle, and the rest completes it.
    socket.write(get("/4") + "GET /5 HTTP/1.1\r\nHo")
    assert_equal 200, read_response(socket)[0]
    sleep 0.1
    socket.write("st: localhost\r\n\r\n")
    assert_equal 200, read_response(socket)[0]
  end

  def test_tls_connections_are_kept_alive_across_idle_periods
    start_tls_server
    sockets = Array.new(30) { tls_connect }
    sockets.each { |ssl| assert_equal 200, request(ssl)[0] }
    wait_idle(30)
    2.times do
      sockets.each { |ssl| assert_equal [200, "hello\n"], request(ssl).values_at(0, 2) }
      wait_idle(30)
    end
  ensure
    sockets&.each { |ssl| ssl.close unless ssl.closed? }
  end

  def start_tls_server
    dir = Dir.mktmpdir("neverblock-idle-tls-")
    cert, key = TestCertificates.write_self_signed(dir)
    @server = NeverBlock::Server.new(ServerHelper::HELLO, bind: ["ssl://127.0.0.1:0?cert=#{cert}&key=#{key}"], workers: 0)
    FileUtils.rm_rf(dir) # read once, by Server.new
    @port = Integer(@server.bound_addresses.first[/\d+\z/])
    @server_thread = Thread.new { @server.run }
  end

  def tls_connect
    context = OpenSSL::SSL::SSLContext.new
    context.verify_mode = OpenSSL::SSL::VERIFY_NONE
    ssl = OpenSSL::SSL::SSLSocket.new(connect, context)
    ssl.sync_close = true
    ssl.connect
    ssl
  end
end

class ServerIdleSetTest < PlainTest
  include IdleConnectionBehaviour

  def setup
    skip "no NeverBlock::Epoll (the C extension is built on Linux only)" unless NeverBlock::Server::IdleSet.available?
    super
  end

  def parks? = true

  # The point of the IdleSet: 200 idle connections, and not a task (so not
  # a fiber) of the server's holds one of them.
  def test_idle_connections_hold_no_fiber
    start_server
    wait_serving
    base = server_tasks
    sockets = idle_connections(200)
    assert_equal base, server_tasks, "tasks besides the server's own"
    assert_operator @server.stats[:connection_fibers][:idle], :<=, NeverBlock::FiberPool::IDLE_LIMIT
  end
  # Going idle together, at most WAITING_FIBERS connections wait in their
  # fibers (until the IdleSweeper parks them); the others park a few
  # milliseconds later (BriefWaits), not after the sweeper's 0.5 s.
  def test_beyond_waiting_fibers_idle_connections_park_soon
    start_server(idle_timeout: 3600) # the sweeper parks after 0.5 s
    count = NeverBlock::Server::IdleSet::WAITING_FIBERS + 100
    sockets = Array.new(count) { connect }
    sockets.each { |socket| socket.write(get) }
    sockets.each { |socket| assert_equal 200, read_response(socket)[0] }
    eventually { @server.stats[:idle_connections] == count }
    eventually { @server.stats[:connection_fibers][:busy] <= NeverBlock::Server::IdleSet::WAITING_FIBERS }
  end

  # The same for busy clients (each sent its second request as soon as its
  # first was answered: they wait briefly, BriefWaits), told apart from
  # the sweeper's parking: the connections beyond the fiber waits park
  # before the sweeper parks those (which it would do in the order they
  # began to wait). Twenty fiber waits instead of 256, so that the
  # connections are all served well within the sweeper's 0.5 s. TURN is
  # raised: a request that a loaded machine slows past it would have its
  # connection wait its turn, parked and in its fiber at once
  # (turn_wait_test.rb), which the counts here leave out.
  def test_busy_connections_beyond_the_fiber_waits_park_before_the_sweeper_comes
    with_constant(NeverBlock::Server::Connection, :TURN, 3600.0) do
      start_server(idle_timeout: 3600)
      wait_serving
      idle_set = @server.instance_variable_get(:@context).idle_set
      idle_set.instance_variable_set(:@waiting_fibers, 20)
      sockets = Array.new(50) { connect }
      sockets.each { |socket| 2.times { assert_equal 200, request(socket)[0] } }
      eventually { idle_set.size == 30 && idle_set.fiber_waits == 20 }
      eventually { idle_set.size == 50 && idle_set.fiber_waits.zero? }
    end
  end
end

class ServerIdleFiberTest < PlainTest
  include IdleConnectionBehaviour
  include FiberPerIdleConnection

  def parks? = false

  # What the IdleSet saves: without it each idle connection holds a task.
  def test_each_idle_connection_holds_a_fiber
    start_server
    wait_serving
    base = server_tasks
    sockets = idle_connections(50)
    assert_equal base + 50, server_tasks
  end
end

# `neverblock serve` with workers: each makes its IdleSet after the fork, and
# keep-alive connections idle in every worker are served again. Handoff is
# off: on a loaded machine a request may take the 1 ms that lets its
# connection move to a less busy sibling (keepalive_fairness_test.rb), and
# here each must come back to the worker whose IdleSet parked it.
class ServerIdleSetWorkersTest < PlainTest
  include ServeProcesses

  def test_idle_connections_in_forked_workers_are_served_again
    server = serve("pids.ru", "-w", "2", env: { "NEVERBLOCK_HANDOFF" => "off" })
    eventually { worker_pids(server[:pid]).size == 2 }
    sockets = Array.new(40) { TCPSocket.new("127.0.0.1", server[:port]) }
    first = sockets.map { |socket| answer(socket) }
    sleep 0.3 # idle in their workers
    assert_equal first, sockets.map { |socket| answer(socket) }, "each connection answered by the same worker"
    assert_empty first.uniq - worker_pids(server[:pid])
  ensure
    sockets&.each(&:close)
  end

  # @return [Integer] the pid of the worker that answered GET / on `socket`
  def answer(socket)
    socket.write("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    head = socket.gets("\r\n\r\n")
    assert_match(/\AHTTP\/1\.1 200 /, head)
    length = Integer(head[/^content-length: (\d+)/i, 1])
    Integer(socket.read(length).split.first)
  end
end
