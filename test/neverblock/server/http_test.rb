# frozen_string_literal: true

require_relative "server_helper"

class ServerHTTPTest < PlainTest
  include ServerHelper

  ECHO_ENV = lambda do |env|
    keys = %w[REQUEST_METHOD SCRIPT_NAME PATH_INFO QUERY_STRING SERVER_NAME SERVER_PORT SERVER_PROTOCOL
              REMOTE_ADDR HTTP_HOST HTTP_X_TEST rack.url_scheme rack.hijack? CONTENT_LENGTH]
    text = keys.map { |key| "#{key}=#{env.key?(key) ? env[key] : '(none)'}" }.join("\n")
    [200, { "content-type" => "text/plain", "content-length" => text.bytesize.to_s }, [text]]
  end

  ECHO_BODY = lambda do |env|
    body = env["rack.input"].read
    text = "#{env['CONTENT_LENGTH']}:#{body}"
    [200, { "content-type" => "text/plain", "content-length" => text.bytesize.to_s }, [text]]
  end

  def env_lines(body)
    body.split("\n").to_h { |line| line.split("=", 2) }
  end

  def test_builds_a_rack_3_env
    start_server(ECHO_ENV)
    socket = connect
    socket.write("GET /a/b?x=1&y=2 HTTP/1.1\r\nHost: example.com:8080\r\nX-Test: yes\r\n\r\n")
    status, _headers, body = read_response(socket)
    env = env_lines(body)
    assert_equal 200, status
    assert_equal({ "REQUEST_METHOD" => "GET", "SCRIPT_NAME" => "", "PATH_INFO" => "/a/b", "QUERY_STRING" => "x=1&y=2",
                   "SERVER_NAME" => "example.com", "SERVER_PORT" => "8080", "SERVER_PROTOCOL" => "HTTP/1.1",
                   "REMOTE_ADDR" => "127.0.0.1", "HTTP_HOST" => "example.com:8080", "HTTP_X_TEST" => "yes",
                   "rack.url_scheme" => "http", "rack.hijack?" => "true", "CONTENT_LENGTH" => "(none)" }, env)
  end

  def test_repeated_headers_are_joined_and_empty_ones_kept
    app = lambda do |env|
      text = [env["HTTP_X_TEST"], env["HTTP_COOKIE"], env["HTTP_X_EMPTY"]].inspect
      [200, { "content-length" => text.bytesize.to_s }, [text]]
    end
    start_server(app)
    socket = connect
    socket.write("GET / HTTP/1.1\r\nHost: a\r\nX-Test: 1\r\nCookie: a=1\r\nX-Empty:\r\nX-Test: 2\r\nCookie: b=2\r\n\r\n")
    assert_equal '["1, 2", "a=1; b=2", ""]', read_response(socket)[2]
  end

  def test_works_with_net_http
    start_server
    response = Net::HTTP.get_response(URI("http://127.0.0.1:#{@port}/"))
    assert_equal "200", response.code
    assert_equal "hello\n", response.body
    refute_nil response["date"]
  end

  def test_adds_a_date_header
    start_server
    socket = connect
    socket.write(get)
    _status, headers, _body = read_response(socket)
    assert_match(/\A\w{3}, \d{2} \w{3} \d{4} \d{2}:\d{2}:\d{2} GMT\z/, headers["date"])
  end

  def test_keeps_an_http_11_connection_alive
    start_server
    socket = connect
    3.times do
      socket.write(get)
      status, headers, body = read_response(socket)
      assert_equal [200, "hello\n"], [status, body]
      assert_nil headers["connection"]
    end
    assert_equal 3, @server.stats[:requests_total]
  end

  def test_answers_pipelined_requests_in_order
    app = lambda do |env|
      sleep(env["PATH_INFO"] == "/1" ? 0.2 : 0) # the first is the slowest
      [200, { "content-type" => "text/plain", "content-length" => env["PATH_INFO"].bytesize.to_s }, [env["PATH_INFO"]]]
    end
    start_server(app)
    socket = connect
    socket.write((1..5).map { |i| get("/#{i}") }.join)
    bodies = 5.times.map { read_response(socket)[2] }
    assert_equal %w[/1 /2 /3 /4 /5], bodies
  end

  def test_connection_close_from_the_client_closes_after_the_response
    start_server
    response = exchange(get("/", "Connection: close\r\n"))
    assert_match(/\AHTTP\/1\.1 200 OK\r\n/, response)
    assert_includes response, "connection: close\r\n"
    assert response.end_with?("hello\n")
  end

  def test_connection_close_from_the_app_closes_after_the_response
    app = ->(_env) { [200, { "content-type" => "text/plain", "content-length" => "2", "connection" => "close" }, ["ok"]] }
    start_server(app)
    response = exchange(get + get) # the second request is never answered
    assert_equal 1, response.scan("HTTP/1.1 200").size
    assert_includes response, "connection: close\r\n"
  end

  def test_http_10_closes_by_default
    start_server
    response = exchange("GET / HTTP/1.0\r\n\r\n")
    assert_match(/\AHTTP\/1\.1 200 OK\r\n/, response)
    assert_includes response, "connection: close\r\n"
  end

  def test_http_10_keep_alive_when_asked
    start_server
    socket = connect
    2.times do
      socket.write("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
      status, headers, body = read_response(socket)
      assert_equal [200, "keep-alive", "hello\n"], [status, headers["connection"], body]
    end
  end

  def test_http_10_streaming_body_is_ended_by_closing
    app = ->(_env) { [200, { "content-type" => "text/plain" }, %w[a b c].each] }
    start_server(app)
    response = exchange("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    refute_includes response, "transfer-encoding"
    assert_includes response, "connection: close\r\n"
    assert response.end_with?("\r\n\r\nabc")
  end

  def test_computes_content_length_for_array_bodies
    app = ->(_env) { [200, { "content-type" => "text/plain" }, %w[ab cd]] }
    start_server(app)
    socket = connect
    socket.write(get)
    _status, headers, body = read_response(socket)
    assert_equal ["4", "abcd"], [headers["content-length"], body]
  end

  def test_streams_each_bodies_with_chunked_encoding
    app = lambda do |_env|
      body = Enumerator.new do |out|
        out << "first,"
        sleep 0.05
        out << "second"
      end
      [200, { "content-type" => "text/plain" }, body]
    end
    start_server(app)
    socket = connect
    socket.write(get)
    _status, headers, body = read_response(socket)
    assert_equal ["chunked", "first,second"], [headers["transfer-encoding"], body]
    socket.write(get) # still alive
    assert_equal 200, read_response(socket)[0]
  end

  def test_streaming_call_bodies
    app = lambda do |_env|
      body = proc do |stream|
        stream.write("one,")
        stream << "two"
        stream.close
      end
      [200, { "content-type" => "text/plain" }, body]
    end
    start_server(app)
    socket = connect
    socket.write(get)
    _status, headers, body = read_response(socket)
    assert_equal ["chunked", "one,two"], [headers["transfer-encoding"], body]
  end

  def test_streaming_body_closed_from_another_fiber_later
    app = lambda do |_env|
      body = proc do |stream|
        NeverBlock.spawn do
          stream.write("late")
          sleep 0.05
          stream.close
        end
      end
      [200, { "content-type" => "text/plain" }, body]
    end
    start_server(app)
    socket = connect
    socket.write(get)
    assert_equal "late", read_response(socket)[2]
  end

  def test_head_has_headers_and_no_body
    start_server
    socket = connect
    socket.write("HEAD / HTTP/1.1\r\nHost: a\r\n\r\n")
    status, headers, body = read_response(socket, head: true)
    assert_equal [200, "6", ""], [status, headers["content-length"], body]
    socket.write(get) # the next response follows at once: no stray body bytes
    assert_equal [200, "hello\n"], read_response(socket).values_at(0, 2)
  end

  def test_no_body_for_204_and_304
    app = ->(env) { [Integer(env["PATH_INFO"][1..]), {}, []] }
    start_server(app)
    socket = connect
    socket.write(get("/204") + get("/304"))
    status, headers, = read_response(socket)
    assert_equal 204, status
    refute headers.key?("content-length")
    assert_equal 304, read_response(socket)[0]
  end

  def test_reads_a_content_length_body
    start_server(ECHO_BODY)
    socket = connect
    socket.write("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhel")
    sleep 0.05
    socket.write("lo")
    assert_equal "5:hello", read_response(socket)[2]
  end

  def test_reads_a_chunked_body
    start_server(ECHO_BODY)
    socket = connect
    socket.write("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    sleep 0.05
    socket.write("6\r\n world\r\n0\r\n\r\n")
    assert_equal "11:hello world", read_response(socket)[2]
  end

  def test_reads_a_large_body
    start_server(ECHO_BODY)
    body = Random.new(1).bytes(1024 * 1024)
    response = Net::HTTP.new("127.0.0.1", @port).post("/", body, "content-type" => "application/octet-stream")
    assert_equal "#{body.bytesize}:".b + body, response.body.b
  end

  def test_chunked_body_with_extensions_and_trailers
    start_server(ECHO_BODY)
    socket = connect
    socket.write("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" \
                 "3;ext=1\r\nabc\r\n0\r\nX-Trailer: t\r\n\r\n")
    assert_equal "3:abc", read_response(socket)[2]
    socket.write(get) # framing intact after the trailer
    assert_equal 200, read_response(socket)[0]
  end

  def test_a_trailer_does_not_reach_the_env
    start_server(ECHO_ENV)
    socket = connect
    socket.write("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\nX-Test: t\r\n\r\n")
    assert_equal "(none)", env_lines(read_response(socket)[2])["HTTP_X_TEST"]
  end

  def test_each_request_on_a_connection_gets_its_own_host
    start_server(ECHO_ENV)
    socket = connect
    names = %w[a.example:81 b.example a.example:81 [::1]:82].map do |host|
      socket.write("GET / HTTP/1.1\r\nHost: #{host}\r\n\r\n")
      env_lines(read_response(socket)[2]).values_at("SERVER_NAME", "SERVER_PORT")
    end
    assert_equal [%w[a.example 81], %w[b.example 80], %w[a.example 81], %w[[::1] 82]], names
  end

  def test_a_bodiless_request_reads_an_empty_input_even_after_an_app_closed_one
    app = lambda do |env|
      input = env["rack.input"]
      lines = []
      input.each { |line| lines << line }
      text = [input.read, input.read(10), input.gets, lines].inspect
      input.close
      [200, { "content-length" => text.bytesize.to_s }, [text]]
    end
    start_server(app)
    socket = connect
    2.times do
      socket.write(get)
      assert_equal '["", nil, nil, []]', read_response(socket)[2]
    end
  end

  def test_server_port_defaults_to_80_when_host_has_no_port
    start_server(ECHO_ENV)
    socket = connect
    socket.write(get)
    assert_equal %w[localhost 80], env_lines(read_response(socket)[2]).values_at("SERVER_NAME", "SERVER_PORT")
  end

  def test_expect_100_continue_before_the_body
    start_server(ECHO_BODY)
    socket = connect
    socket.write("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n")
    assert_equal 100, read_response(socket)[0]
    socket.write("body")
    assert_equal [200, "4:body"], read_response(socket).values_at(0, 2)
  end

  def test_net_http_with_expect_100_continue
    start_server(ECHO_BODY)
    http = Net::HTTP.new("127.0.0.1", @port)
    http.continue_timeout = 5
    request = Net::HTTP::Post.new("/", "expect" => "100-continue", "content-type" => "text/plain")
    request.body = "x" * 1000
    response = http.request(request)
    assert_equal "1000:#{'x' * 1000}", response.body
  end

  def test_header_values_may_be_arrays
    app = ->(_env) { [200, { "set-cookie" => %w[a=1 b=2], "content-length" => "0" }, []] }
    start_server(app)
    response = exchange(get("/", "Connection: close\r\n"))
    assert_includes response, "set-cookie: a=1\r\nset-cookie: b=2\r\n"
  end

  # A CR or LF inside a value would end the header line and let the value
  # write headers (or a body) of its own: each line is sent as a value of
  # the same header instead. (Rack::Lint refuses such a value: not a
  # conforming app, but one the server must not let split the response.)
  def test_a_newline_in_a_header_value_cannot_split_the_response
    app = ->(_env) { [200, { "x-a" => "1\r\nset-cookie: evil=1", "x-b" => "2\rx-c: 3", "x-d" => ["4\n\nbody"], "content-length" => "0" }, []] }
    start_server(app, lint: false)
    response = exchange(get("/", "Connection: close\r\n"))
    head = response.split("\r\n\r\n", 2).first
    assert_includes head, "x-a: 1\r\nx-a: set-cookie: evil=1\r\n"
    assert_includes head, "x-b: 2\r\nx-b: x-c: 3\r\n"
    assert_includes head, "x-d: 4\r\nx-d: body\r\n"
    refute_match(/^(?:set-cookie|x-c|body)/, head)
  end

  def test_upgrade_requests_are_answered_then_closed_without_hijack
    start_server
    response = exchange("GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
    assert_match(/\AHTTP\/1\.1 200 OK\r\n.*hello\n\z/m, response)
  end

  def test_invalid_bind_spec_is_refused
    error = assert_raises(ArgumentError) { NeverBlock::Server.new(ServerHelper::HELLO, bind: ["http://x:1"]) }
    assert_match(%r{tcp://HOST:PORT, unix://PATH or ssl://HOST:PORT\?cert=PATH&key=PATH}, error.message)
  end

  def test_a_server_runs_once
    start_server
    @server.stop
    assert @server_thread.join(10)
    assert_raises(NeverBlock::Error) { @server.run }
  end

  def test_unix_socket
    path = File.join(Dir.tmpdir, "nb-server-#{Process.pid}-#{rand(1 << 30)}.sock")
    @server = NeverBlock::Server.new(Rack::Lint.new(ECHO_ENV), bind: ["unix://#{path}"], workers: 0)
    assert_equal ["unix://#{path}"], @server.bound_addresses
    @server_thread = Thread.new { @server.run }
    socket = UNIXSocket.new(path)
    socket.write(get)
    env = env_lines(read_response(socket)[2])
    socket.close
    assert_equal "localhost", env["SERVER_NAME"]
    @server.stop
    @server_thread.join(20)
    refute File.exist?(path)
  end
end

# The same requests with every head parsed by llhttp's callbacks (no C fast path).
class ServerHTTPLlhttpHeadsTest < ServerHTTPTest
  include LlhttpHeads

  def test_heads_go_through_llhttp
    refute NeverBlock::Server::Parser.head_parser?, "the fast path is off"
  end
end
