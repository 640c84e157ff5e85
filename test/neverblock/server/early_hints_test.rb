# frozen_string_literal: true

require_relative "server_helper"

# `early_hints: true`: env["rack.early_hints"] sends `103 Early Hints`
# before the final response, to HTTP/1.1 clients only.
class ServerEarlyHintsTest < PlainTest
  include ServerHelper

  # Idle keep-alive clients would hold the server's stop for its 1 s grace.
  def teardown
    @sockets&.each { |socket| socket.close unless socket.closed? }
    super
  end

  PRELOAD = "</style.css>; rel=preload; as=style"

  # Sends the hints of `hints` (if the key is there), then answers 200 with
  # whether the key was there and what the call returned or raised.
  def hinting_app(hints)
    lambda do |env|
      callback = env["rack.early_hints"]
      result = begin
        callback ? callback.call(hints).inspect : "absent"
      rescue ArgumentError => e
        "refused: #{e.message}"
      end
      [200, { "content-type" => "text/plain" }, ["#{result}\n"]]
    end
  end

  # Reads 103 blocks and the final response off `socket`:
  # [[hint headers of each 103 (lines)], final status, final body].
  def read_hints_and_response(socket)
    hints = []
    loop do
      status, headers, body = read_response(socket)
      return [hints, status, body] unless status == 103

      hints << headers
    end
  end

  def test_a_raw_client_sees_the_103_then_the_200
    start_server(hinting_app({ "link" => [PRELOAD, "</app.js>; rel=preload; as=script"] }), early_hints: true)
    socket = connect
    socket.write(get)
    raw = +""
    raw << socket.readpartial(65_536) until raw.include?("nil\n")
    assert raw.start_with?("HTTP/1.1 103 Early Hints\r\nlink: #{PRELOAD}\r\n" \
                           "link: </app.js>; rel=preload; as=script\r\n\r\nHTTP/1.1 200 OK\r\n"), raw
  end

  def test_hints_come_before_the_app_answers
    sent = Queue.new
    app = lambda do |env|
      env["rack.early_hints"].call({ "link" => PRELOAD })
      sent.pop # the client has seen the 103 while the app still works
      [200, { "content-type" => "text/plain", "content-length" => "3" }, ["ok\n"]]
    end
    start_server(app, early_hints: true)
    socket = connect
    socket.write(get)
    status, headers, = read_response(socket)
    assert_equal 103, status
    assert_equal PRELOAD, headers["link"]
    sent << true
    assert_equal [200, "ok\n"], read_response(socket).values_at(0, 2)
  end

  def test_net_http_ignores_the_103_and_gets_the_200
    start_server(hinting_app({ "link" => PRELOAD }), early_hints: true)
    response = Net::HTTP.get_response(URI("http://127.0.0.1:#{@port}/"))
    assert_equal "200", response.code
    assert_equal "nil\n", response.body
  end

  def test_keep_alive_requests_each_get_their_hints
    start_server(hinting_app({ "link" => PRELOAD }), early_hints: true)
    socket = connect
    2.times do
      socket.write(get)
      assert_equal [[{ "link" => PRELOAD }], 200, "nil\n"], read_hints_and_response(socket)
    end
  end

  def test_http_1_0_has_no_early_hints_key
    start_server(hinting_app({ "link" => PRELOAD }), early_hints: true)
    response = exchange("GET / HTTP/1.0\r\n\r\n")
    assert_match(%r{\AHTTP/1\.1 200 OK\r\n}, response)
    assert response.end_with?("absent\n"), response
    refute_includes response, "103"
  end

  def test_off_by_default
    start_server(hinting_app({ "link" => PRELOAD }))
    socket = connect
    socket.write(get)
    assert_equal [[], 200, "absent\n"], read_hints_and_response(socket)
  end

  def test_header_injection_is_refused_and_nothing_is_written
    {
      { "link" => "</a.css>\r\nset-cookie: stolen=1" } => /invalid value for link/,
      { "link" => ["</a.css>", "x\ny"] } => /invalid value for link/,
      { "bad name" => "v" } => /invalid header name "bad name"/,
      { "x-a\r\nset-cookie" => "v" } => /invalid header name/,
      { "link" => 1 } => /invalid value for link: 1/
    }.each do |hints, message|
      start_server(hinting_app(hints), early_hints: true, lint: false) # Lint refuses them first
      socket = connect
      socket.write(get)
      received, status, body = read_hints_and_response(socket)
      assert_equal [[], 200], [received, status], hints.inspect
      assert_match message, body
      socket.close
      @server.stop
      @server_thread.join(10)
      @server = nil
    end
  end

  def test_a_call_after_the_app_returned_writes_nothing
    kept = Queue.new
    body = Object.new
    body.define_singleton_method(:each) do |&block|
      kept.pop.call({ "link" => PRELOAD }) # from the body, once the response is being written
      block.call("done\n")
    end
    app = lambda do |env|
      kept << env["rack.early_hints"]
      [200, { "content-type" => "text/plain" }, body]
    end
    start_server(app, early_hints: true, lint: false)
    socket = connect
    socket.write(get)
    assert_equal [[], 200, "done\n"], read_hints_and_response(socket)
  end

  def test_early_hints_must_be_a_boolean
    error = assert_raises(ArgumentError) { NeverBlock::Server.new(HELLO, workers: 0, early_hints: "yes") }
    assert_match(/early_hints must be true or false/, error.message)
  end
end

# `neverblock serve --early-hints` and `--no-early-hints`, as real processes.
class ServerEarlyHintsCommandTest < PlainTest
  include ServerProcess

  EXE = File.expand_path("../../../exe/neverblock", __dir__)
  APP = File.expand_path("../../fixtures/server/early_hints.ru", __dir__)

  # What a raw HTTP/1.1 client reads for GET / on `port`, up to the final body.
  def raw_exchange(port)
    wait_for_answer(port)
    socket = TCPSocket.new("127.0.0.1", port)
    socket.write("GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
    socket.read
  ensure
    socket&.close
  end

  def test_early_hints_switch_on
    port = free_port
    start(RbConfig.ruby, EXE, "serve", APP, "-b", "tcp://127.0.0.1:#{port}", "-w", "0", "--early-hints")
    response = raw_exchange(port)
    assert response.start_with?("HTTP/1.1 103 Early Hints\r\nlink: </style.css>; rel=preload; as=style\r\n\r\n" \
                                "HTTP/1.1 200 OK\r\n"), response
    assert response.end_with?("hinted\n"), response
  end

  def test_rackup_o_early_hints
    port = free_port
    start(RbConfig.ruby, Gem.bin_path("rackup", "rackup"), "-s", "neverblock", "-o", "127.0.0.1", "-p", port.to_s,
          "-E", "none", "-O", "EarlyHints=true", APP)
    assert_match(/\AHTTP\/1\.1 103 Early Hints\r\n.*HTTP\/1\.1 200 OK\r\n.*hinted\n\z/m, raw_exchange(port))
  end

  def test_no_early_hints_wins_when_given_last
    port = free_port
    start(RbConfig.ruby, EXE, "serve", APP, "-b", "tcp://127.0.0.1:#{port}", "-w", "0", "--early-hints", "--no-early-hints")
    response = raw_exchange(port)
    assert response.start_with?("HTTP/1.1 200 OK\r\n"), response
    assert response.end_with?("no hints\n"), response
  end
end
