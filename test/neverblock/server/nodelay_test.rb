# frozen_string_literal: true

require_relative "server_helper"

# Responses go out without Nagle's delay: every accepted TCP connection has
# TCP_NODELAY, from its listener where the kernel copies it into the
# connections it accepts (Linux), else set on each connection.
class ServerNodelayTest < PlainTest
  include ServerHelper

  # Answers with the hijacked socket's TCP_NODELAY (0 or 1).
  NODELAY = lambda do |env|
    io = env["rack.hijack"].call
    nodelay = io.getsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY).int.positive? ? 1 : 0
    io.write("HTTP/1.1 200 OK\r\ncontent-length: 1\r\nconnection: close\r\n\r\n#{nodelay}")
    io.close
    [200, {}, []]
  end

  def nodelay_seen
    socket = connect
    socket.write("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    socket.read[-1]
  end

  def test_an_accepted_connection_has_tcp_nodelay
    start_server(NODELAY, lint: false)
    assert_equal NeverBlock::Server::Listener::NODELAY_INHERITED, listener.nodelay?
    assert_equal "1", nodelay_seen
  end

  # A listener whose connections do not inherit it (as on the BSDs): each
  # connection sets it itself.
  def test_a_connection_sets_tcp_nodelay_when_its_listener_gives_none
    start_server(NODELAY, lint: false)
    listener.io.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 0)
    listener.instance_variable_set(:@nodelay, false)
    assert_equal "1", nodelay_seen
  end

  def test_a_listener_copies_tcp_nodelay_into_its_connections_on_linux
    skip "the kernel does not promise to copy it (#{RUBY_PLATFORM})" unless NeverBlock::Server::Listener::NODELAY_INHERITED
    listener = NeverBlock::Server::Listener.new("tcp://127.0.0.1:0").listen
    assert_predicate listener, :nodelay?
    client = TCPSocket.new("127.0.0.1", listener.port)
    accepted = listener.io.accept
    assert_equal 1, accepted.getsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY).int
    unix = NeverBlock::Server::Listener.new("unix://#{Dir.tmpdir}/nb-nodelay-#{Process.pid}.sock").listen
    refute_predicate unix, :nodelay?
  ensure
    [client, accepted].each { |io| io&.close }
    listener&.close
    unix&.close
  end

  private

  def listener
    @server.instance_variable_get(:@listeners).first
  end
end
