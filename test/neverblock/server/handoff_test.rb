# frozen_string_literal: true

require_relative "server_helper"
require "neverblock/server"

# The Handoff itself, with real sockets: two worker indexes of one Handoff
# (two attached copies, as two forked workers would hold them), a listening
# socket and its clients. What a whole server does with it is in
# ServerKeepAliveFairnessTest.
class ServerHandoffTest < PlainTest
  Handoff = NeverBlock::Server::Handoff

  def setup
    skip "no handoff here: it needs IO::Buffer.map and SCM_RIGHTS" unless Handoff.available?

    @listeners = [Object.new, Object.new] # Handoff keeps them by identity, in every worker's order
    @active = [0, 0]
    @handoff = Handoff.new(2)
    @workers = Array.new(2) do |index|
      @handoff.dup.tap { |worker| assert worker.attach(index, @listeners, -> { @active[index] }) }
    end
    @server = TCPServer.new("127.0.0.1", 0)
    @sockets = []
  end

  def teardown
    (@sockets || []).each { |socket| socket.close unless socket.closed? }
    @server&.close
  end

  # A client connected to the listening socket, and the server's end of it.
  def connection
    client = TCPSocket.new("127.0.0.1", @server.local_address.ip_port)
    accepted = @server.accept
    @sockets.push(client, accepted)
    [client, accepted]
  end

  def open_both(busy:, idle:)
    @active.replace([busy, idle])
    @workers.each(&:open)
  end

  def test_a_connection_moves_to_a_sibling_serving_two_fewer_and_its_bytes_follow
    open_both(busy: 5, idle: 3)
    client, accepted = connection
    client.write("GET / HTTP/1.1\r\n\r\n") # sent before the move: waits in the socket
    assert @workers[0].hand_off(accepted, @listeners[1], 1.0)
    accepted.close # what the connection does here once passed: the client's connection stays open

    socket, listener = @workers[1].receive
    @sockets << socket
    assert_same @listeners[1], listener
    assert_equal "GET / HTTP/1.1\r\n\r\n", socket.readpartial(100)
    socket.write("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
    assert_equal "HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n", client.readpartial(100)
    assert_nil @workers[1].receive, "one message, one connection"
  end

  # As between forked workers: the scoreboard is shared memory, and the
  # socket crosses processes with the request in it.
  def test_a_connection_moves_to_a_forked_sibling
    reader, writer = IO.pipe
    ready_reader, ready_writer = IO.pipe
    pid = fork do
      reader.close
      ready_reader.close
      sibling = @handoff.dup
      sibling.attach(1, @listeners, -> { 0 })
      sibling.open
      ready_writer.write("open\n")
      received = nil
      received = sibling.receive until received || !sibling.wait_readable
      socket, listener = received
      writer.write("#{@listeners.index(listener)} #{socket.readpartial(100)}")
      socket.write("HTTP/1.1 204 No Content\r\n\r\n")
      exit!(0)
    end
    writer.close
    ready_writer.close
    assert_equal "open\n", ready_reader.gets
    @active[0] = 4
    @workers[0].open
    client, accepted = connection
    client.write("GET /moved HTTP/1.1\r\n\r\n")
    assert @workers[0].hand_off(accepted, @listeners[1], 1.0)
    accepted.close
    assert_equal "1 GET /moved HTTP/1.1\r\n\r\n", reader.read
    assert_equal "HTTP/1.1 204 No Content\r\n\r\n", client.readpartial(100)
  ensure
    if pid
      Process.kill("KILL", pid) # it has exited, unless the move failed and it still waits
      Process.wait(pid)
    end
  end

  def test_no_move_to_a_sibling_serving_only_one_fewer
    open_both(busy: 4, idle: 3)
    _client, accepted = connection
    refute @workers[0].hand_off(accepted, @listeners[0], 1.0)
    assert_nil @workers[1].receive
  end

  def test_no_move_to_a_sibling_whose_slot_is_closed
    open_both(busy: 9, idle: 0)
    @workers[1].close # it is stopping
    _client, accepted = connection
    refute @workers[0].hand_off(accepted, @listeners[0], 1.0)
  end

  # A move counts on both sides until the sibling publishes: the next
  # requests do not all pick the same sibling.
  def test_a_move_counts_on_both_sides_until_the_sibling_publishes
    open_both(busy: 6, idle: 3)
    _client, accepted = connection
    assert @workers[0].hand_off(accepted, @listeners[0], 1.0)
    _client, other = connection
    @active[0] = 5 # the first one left
    refute @workers[0].hand_off(other, @listeners[0], 2.0), "the sibling counts 4 now, only one fewer"
    @workers[1].receive&.first&.then { |socket| @sockets << socket }
  end

  def test_it_looks_at_the_scoreboard_at_most_once_an_interval
    open_both(busy: 9, idle: 0)
    _client, first = connection
    _client, second = connection
    assert @workers[0].hand_off(first, @listeners[0], 1.0)
    refute @workers[0].hand_off(second, @listeners[0], 1.0 + Handoff::INTERVAL / 2)
    assert @workers[0].hand_off(second, @listeners[0], 1.0 + Handoff::INTERVAL)
    2.times { @sockets << @workers[1].receive.first }
  end

  # The kernel's queue of a pair is bounded (by the sending end's buffer,
  # made small here so that a few messages fill it): past it the move is
  # refused and the connection stays where it is, served.
  def test_a_full_queue_refuses_and_the_connection_stays
    @handoff.instance_variable_get(:@pairs)[1].first.setsockopt(Socket::SOL_SOCKET, Socket::SO_SNDBUF, 1)
    open_both(busy: 10_000, idle: 0)
    passed = 0
    refused = nil
    200.times do |turn|
      _client, accepted = connection
      if @workers[0].hand_off(accepted, @listeners[0], turn.to_f)
        passed += 1
        accepted.close
      else
        refused = accepted
        break
      end
    end
    assert refused, "the queue never filled (#{passed} moved)"
    refute refused.closed?
    passed.times { @sockets << @workers[1].receive.first }
    assert_nil @workers[1].receive
  end

  # The master clears a dead worker's slot, but not its successor's.
  def test_vacate_clears_only_the_pid_that_holds_the_slot
    open_both(busy: 9, idle: 0)
    @handoff.vacate(1, Process.pid + 1) # a predecessor that exited after its successor opened
    _client, accepted = connection
    assert @workers[0].hand_off(accepted, @listeners[0], 1.0)
    @sockets << @workers[1].receive.first
    @handoff.vacate(1, Process.pid)
    _client, other = connection
    refute @workers[0].hand_off(other, @listeners[0], 2.0)
  end

  # The master pauses moves while it replaces or stops workers.
  def test_no_move_while_the_master_pauses_them
    open_both(busy: 9, idle: 0)
    @handoff.paused = true
    _client, accepted = connection
    refute @workers[0].hand_off(accepted, @listeners[0], 1.0)
    @handoff.paused = false
    assert @workers[0].hand_off(accepted, @listeners[0], 2.0)
    @sockets << @workers[1].receive.first
  end

  def test_off_with_the_switch_or_fewer_than_two_workers
    assert_nil Handoff.build(1)
    previous = ENV.fetch(Handoff::SWITCH, nil)
    ENV[Handoff::SWITCH] = "off"
    assert_nil Handoff.build(2)
  ensure
    ENV[Handoff::SWITCH] = previous
  end
end
