# frozen_string_literal: true

require_relative "server_helper"
require "digest/sha1"

class ServerHijackTest < PlainTest
  include ServerHelper

  WEBSOCKET_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"

  def self.accept_key(key)
    [Digest::SHA1.digest(key + WEBSOCKET_GUID)].pack("m0")
  end

  # A minimal WebSocket server: answers the handshake with a 101 over the
  # hijacked socket, then echoes text frames in a task of its own until a
  # close frame or EOF, and closes the socket (it is the app's).
  WEBSOCKET_ECHO = lambda do |env|
    unless env["HTTP_UPGRADE"]&.casecmp?("websocket")
      return [426, { "content-type" => "text/plain", "content-length" => "9", "upgrade" => "websocket" }, ["websocket"]]
    end

    io = env["rack.hijack"].call
    io.write("HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\n" \
             "sec-websocket-accept: #{accept_key(env['HTTP_SEC_WEBSOCKET_KEY'])}\r\n\r\n")
    NeverBlock.spawn do
      loop do
        first, second = io.read(2)&.bytes
        break if first.nil? || (first & 0x0f) == 8 # EOF or a close frame

        mask = io.read(4).bytes
        payload = io.read(second & 0x7f).bytes.each_with_index.map { |byte, i| byte ^ mask[i % 4] }.pack("C*")
        io.write([0x81, payload.bytesize].pack("CC") + payload)
      end
    ensure
      io.close
    end
    [200, {}, []] # ignored after a full hijack (Rack::Lint still wants a valid response)
  end

  def handshake(key = "dGhlIHNhbXBsZSBub25jZQ==")
    "GET /chat HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" \
      "Sec-WebSocket-Key: #{key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
  end

  def client_frame(text, opcode: 1)
    mask = Array.new(4) { rand(256) }
    [0x80 | opcode, 0x80 | text.bytesize, *mask].pack("C*") +
      text.bytes.each_with_index.map { |byte, i| byte ^ mask[i % 4] }.pack("C*")
  end

  def read_frame(socket)
    first, length = socket.read(2).bytes
    [first & 0x0f, socket.read(length)]
  end

  def test_env_offers_full_and_partial_hijack
    seen = nil
    start_server(lambda do |env|
      seen = [env["rack.hijack?"], env["rack.hijack"].respond_to?(:call)]
      ServerHelper::HELLO.call(env)
    end)
    socket = connect
    socket.write(get)
    assert_equal 200, read_response(socket)[0]
    assert_equal [true, true], seen
  end

  def test_full_hijack_also_sets_rack_hijack_io_for_older_libraries
    start_server(lambda do |env|
      io = env["rack.hijack"].call
      env["rack.hijack_io"].write("HTTP/1.1 204 No Content\r\n\r\n") # the same socket
      io.close
      [200, {}, []]
    end)
    assert_equal "HTTP/1.1 204 No Content\r\n\r\n", exchange(get)
  end

  def test_websocket_handshake_then_frames_both_ways
    start_server(WEBSOCKET_ECHO)
    socket = connect
    socket.write(handshake)
    status, headers, = read_response(socket)
    assert_equal 101, status
    assert_equal "websocket", headers["upgrade"]
    assert_equal "s3pPLMBiTxaQ9kYGzzhZRbK+xOo=", headers["sec-websocket-accept"] # RFC 6455's example
    %w[hello neverblock].each do |text|
      socket.write(client_frame(text))
      assert_equal [1, text], read_frame(socket)
    end
    eventually { @server.stats[:connections].zero? && @server.stats[:requests_in_flight].zero? }

    socket.write(client_frame("", opcode: 8))
    assert_equal "", read_all(socket), "the app closes the socket after the close frame"
  end

  def test_upgrade_request_split_across_reads_still_hijacks
    start_server(WEBSOCKET_ECHO)
    socket = connect
    request = handshake
    socket.write(request[0, 40])
    sleep 0.05 # let the server read the first part on its own
    socket.write(request[40..])
    assert_equal 101, read_response(socket)[0]
    socket.write(client_frame("split"))
    assert_equal [1, "split"], read_frame(socket)
    socket.close # ends the app's echo task, which Server#stop waits for
  end

  def test_pipelined_request_before_an_upgrade_is_answered_first
    start_server(lambda do |env|
      env["PATH_INFO"] == "/chat" ? WEBSOCKET_ECHO.call(env) : ServerHelper::HELLO.call(env)
    end)
    socket = connect
    socket.write(get("/first") + handshake)
    assert_equal [200, "hello\n"], read_response(socket).values_at(0, 2)
    assert_equal 101, read_response(socket)[0]
    socket.write(client_frame("after"))
    assert_equal [1, "after"], read_frame(socket)
    socket.close
  end

  def test_bytes_after_an_upgrade_in_the_same_read_are_refused_with_400
    called = false
    start_server(->(env) { called = true; WEBSOCKET_ECHO.call(env) })
    response = exchange(handshake + client_frame("too early"))
    assert_match(/\AHTTP\/1\.1 400 /, response)
    refute called, "the app never saw the request whose following bytes were lost"
  end

  def test_bytes_after_an_upgrade_split_across_reads_are_refused_with_400
    start_server(WEBSOCKET_ECHO)
    socket = connect
    request = handshake + "x"
    socket.write(request[0, 40])
    sleep 0.05
    socket.write(request[40..])
    assert_match(/\AHTTP\/1\.1 400 /, read_all(socket))
  end

  def test_upgrade_not_hijacked_is_answered_then_closed
    start_server
    response = exchange(handshake)
    assert_match(/\AHTTP\/1\.1 200 OK\r\n/, response)
    assert_match(/^connection: close\r\n/, response)
    assert response.end_with?("\r\n\r\nhello\n"), response
  end

  def test_connect_reaches_the_app_which_may_tunnel
    start_server(lambda do |env|
      io = env["rack.hijack"].call
      io.write("HTTP/1.1 200 Connection Established\r\n\r\ntunnel to #{env['PATH_INFO']}\n")
      io.close
      [200, {}, []]
    end)
    response = exchange("CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    assert_equal "HTTP/1.1 200 Connection Established\r\n\r\ntunnel to example.com:443\n", response
  end

  def test_the_response_returned_after_a_full_hijack_is_ignored
    start_server(lambda do |env|
      io = env["rack.hijack"].call
      io.write("HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n")
      io.close
      [500, { "content-type" => "text/plain" }, ["ignored"]]
    end)
    assert_equal "HTTP/1.1 204 No Content\r\nconnection: close\r\n\r\n", exchange(get)
  end

  def test_hijack_with_pipelined_bytes_already_read_is_refused
    start_server(lambda do |env|
      return ServerHelper::HELLO.call(env) unless env["PATH_INFO"] == "/hijack"

      env["rack.hijack"].call
      [200, {}, []]
    rescue NeverBlock::Error => e
      [409, { "content-type" => "text/plain", "content-length" => "7" }, [e.message[/refused/]]]
    end)
    socket = connect
    socket.write(get("/hijack") + get("/next"))
    assert_equal [409, "refused"], read_response(socket).values_at(0, 2)
    assert_equal [200, "hello\n"], read_response(socket).values_at(0, 2), "the connection goes on"
  end

  def test_partial_hijack_streams_after_the_headers
    start_server(lambda do |_env|
      stream = lambda do |io|
        3.times do |i|
          io.write("part #{i}\n")
          sleep 0.02
        end
        io.close
      end
      [200, { "content-type" => "text/plain", "rack.hijack" => stream }, []]
    end)
    response = exchange(get)
    head, body = response.split("\r\n\r\n", 2)
    assert_match(/\AHTTP\/1\.1 200 OK\r\ncontent-type: text\/plain\r\ndate: [^\r]+\z/, head)
    refute_match(/content-length|transfer-encoding|rack\.hijack|connection/i, head)
    assert_equal "part 0\npart 1\npart 2\n", body
  end

  def test_hijacked_sockets_are_the_apps_not_the_servers
    sockets = Thread::Queue.new
    GC.start # sockets earlier tests dropped without closing
    fds = fd_count
    start_server(lambda do |env|
      sockets << [env["PATH_INFO"], env["rack.hijack"].call]
      [200, {}, []]
    end)
    clients = Array.new(5) { |i| connect.tap { |socket| socket.write(get("/#{i}")) } }
    taken = Array.new(5) { Timeout.timeout(10) { sockets.pop } }.sort.map(&:last)
    eventually { @server.stats[:connections].zero? && @server.stats[:requests_in_flight].zero? }
    assert_equal 5, @server.stats[:requests_total]

    @server.stop
    assert @server_thread.join(20), "the server waited for hijacked connections"
    @server = nil
    taken.zip(clients) do |io, client|
      refute io.closed?, "Server#stop closed a hijacked socket"
      io.write("still mine\n")
      io.close
      assert_equal "still mine\n", read_all(client)
      client.close
    end
    # No more than before (earlier tests' descriptors may still close meanwhile, so not "equal").
    assert_operator fd_count, :<=, fds, "file descriptors leaked"
  end

  def test_an_app_that_raises_after_hijacking_keeps_the_socket_and_is_logged
    taken = Thread::Queue.new
    log = capture_log do
      start_server(lambda do |env|
        taken << env["rack.hijack"].call
        raise "boom after hijack"
      end)
      socket = connect
      socket.write(get)
      io = Timeout.timeout(10) { taken.pop }
      eventually { @server.stats[:requests_in_flight].zero? }
      refute io.closed?
      io.write("from the app\n")
      io.close
      assert_equal "from the app\n", read_all(socket), "no 500 after a hijack"
    end
    assert_match(/boom after hijack/, log)
  end
end

# Where an upgrade request ends, wherever the reads split it: the parser
# hands it over only when nothing followed it.
class ServerParserUpgradeTest < PlainTest
  UPGRADE = "GET /chat HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
  BEFORE = "GET /first HTTP/1.1\r\nHost: a\r\n\r\n"

  def parse(pieces)
    parser = NeverBlock::Server::Parser.new(NeverBlock::Server::Limits.build({}), {}, "localhost", "80")
    error = nil
    pieces.each do |piece|
      parser << piece
    rescue NeverBlock::Server::HTTPError => e
      error = e
      break
    end
    [error&.status, parser.requests.map { |request| request.env["PATH_INFO"] }]
  end

  def splits(bytes)
    (1...bytes.bytesize).map { |at| [bytes.byteslice(0, at), bytes.byteslice(at, bytes.bytesize)] }
  end

  def test_an_upgrade_is_handed_over_at_any_split
    [UPGRADE, BEFORE + UPGRADE].each do |bytes|
      expected = bytes == UPGRADE ? ["/chat"] : ["/first", "/chat"]
      ([[bytes]] + splits(bytes)).each do |pieces|
        assert_equal [nil, expected], parse(pieces), pieces.inspect
      end
    end
  end

  def test_bytes_after_an_upgrade_refuse_it_at_any_split
    [UPGRADE + "x", BEFORE + UPGRADE + "\x81\x80".b, UPGRADE + BEFORE].each do |bytes|
      expected = bytes.start_with?(BEFORE) ? ["/first"] : []
      ([[bytes]] + splits(bytes)).each do |pieces|
        status, paths = parse(pieces)
        # Split right after the upgrade, the extra bytes come in a read the
        # parser never sees (the connection stops reading): handed over.
        upgrade_end = bytes.index(UPGRADE) + UPGRADE.bytesize
        if pieces.size == 2 && pieces.first.bytesize == upgrade_end
          assert_equal [nil, expected + ["/chat"]], [status, paths], pieces.inspect
        else
          assert_equal [400, expected], [status, paths], pieces.inspect
        end
      end
    end
  end

  # The parser frames bodies itself, so it knows where an upgrade after a
  # body that spanned reads ends (llhttp alone could not say).
  def test_an_upgrade_after_a_body_split_across_reads_is_handed_over
    body_then_upgrade = "POST /body HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nab"
    assert_equal [nil, ["/body", "/chat"]], parse([body_then_upgrade, "cd#{UPGRADE}"])
    assert_equal [400, ["/body"]], parse([body_then_upgrade, "cd#{UPGRADE}x"])
    chunked = "POST /body HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab"
    assert_equal [nil, ["/body", "/chat"]], parse([chunked, "\r\n0\r\n\r\n#{UPGRADE}"])
  end
end
