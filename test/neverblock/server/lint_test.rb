# frozen_string_literal: true

require_relative "server_helper"

# Every response path, with the app wrapped in Rack::Lint (start_server
# does that). A Lint failure inside the app becomes a 500; one in the
# body's each/close happens after the response went out and is only
# logged, so each test also checks what the server logged.
class ServerLintTest < PlainTest
  include ServerHelper

  TEXT = { "content-type" => "text/plain" }.freeze

  # Runs the block against a server for `app` and asserts that no error was
  # logged (or, with `expect_log:`, that the log matches it and has no
  # Lint error).
  def lint_clean(app, expect_log: nil, **options)
    log = capture_log do
      start_server(app, **options)
      yield
      eventually { @server.stats[:requests_in_flight].zero? }
    end
    refute_match(/LintError/, log)
    # Only errors count: a loaded machine may add a stall detector warning.
    expect_log ? assert_match(expect_log, log) : refute_match(/ERROR/, log)
  end

  def test_array_body
    lint_clean(ServerHelper::HELLO) do
      assert_equal [200, "hello\n"], exchange_one(get).values_at(0, 2)
    end
  end

  def test_each_body_streamed_chunked
    app = ->(_env) { [200, TEXT.dup, %w[a bc def].each] }
    lint_clean(app) { assert_equal [200, "abcdef"], exchange_one(get).values_at(0, 2) }
  end

  def test_call_body_reads_the_request_and_streams
    app = lambda do |env|
      [200, TEXT.dup, lambda do |stream|
        stream.write("got ")
        stream << env["rack.input"].read
        stream.flush
        stream.close
      end]
    end
    lint_clean(app) do
      assert_equal [200, "got body"], exchange_one("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 4\r\n\r\nbody").values_at(0, 2)
    end
  end

  def test_head
    app = ->(_env) { [200, { "content-type" => "text/plain", "content-length" => "6" }, []] }
    lint_clean(app) do
      status, headers, = exchange_one("HEAD / HTTP/1.1\r\nHost: a\r\n\r\n", head: true)
      assert_equal [200, "6"], [status, headers["content-length"]]
    end
  end

  def test_204_and_304
    app = ->(env) { [env["PATH_INFO"] == "/204" ? 204 : 304, {}, []] }
    lint_clean(app) do
      assert_equal 204, exchange_one(get("/204"))[0]
      assert_equal 304, exchange_one(get("/304"))[0]
    end
  end

  def test_expect_100_continue
    app = ->(env) { [200, TEXT.dup, [env["rack.input"].read]] }
    lint_clean(app) do
      socket = connect
      socket.write("POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
      assert_equal 100, read_response(socket)[0]
      socket.write("ok")
      assert_equal [200, "ok"], read_response(socket).values_at(0, 2)
    end
  end

  def test_chunked_request_body_and_rack_input_methods
    app = lambda do |env|
      input = env["rack.input"]
      first = input.gets
      rest = []
      input.each { |line| rest << line }
      [200, TEXT.dup, ["#{first}#{rest.join}:#{env['CONTENT_LENGTH']}"]]
    end
    lint_clean(app) do
      request = "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n4\r\na\nb\n\r\n0\r\n\r\n"
      assert_equal "a\nb\n:4", exchange_one(request)[2]
    end
  end

  def test_http_10
    lint_clean(ServerHelper::HELLO) { assert_match(/\AHTTP\/1\.1 200 OK/, exchange("GET / HTTP/1.0\r\n\r\n")) }
  end

  def test_app_error_is_a_500
    lint_clean(->(_env) { raise "app bug" }, expect_log: /app bug/) do
      assert_equal 500, exchange_one(get)[0]
    end
  end

  def test_error_in_each_after_the_headers
    app = ->(_env) { [200, TEXT.dup, Enumerator.new { |out| out << "part"; raise "each bug" }] }
    lint_clean(app, expect_log: /each bug/) { assert_match(/\AHTTP\/1\.1 200 OK/, exchange(get)) }
  end

  def test_response_finished_callbacks
    called = Thread::Queue.new
    app = lambda do |env|
      env["rack.response_finished"] << ->(_env, status, _headers, error) { called << [status, error] }
      ServerHelper::HELLO.call(env)
    end
    lint_clean(app) do
      exchange_one(get)
      assert_equal [200, nil], Timeout.timeout(10) { called.pop }
    end
  end

  def test_full_hijack
    app = lambda do |env|
      io = env["rack.hijack"].call
      io.write("HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi")
      io.close
      [200, {}, []]
    end
    lint_clean(app) { assert_match(/\r\n\r\nhi\z/, exchange(get)) }
  end

  def test_partial_hijack
    app = lambda do |_env|
      [200, { "rack.hijack" => ->(stream) { stream.write("partial"); stream.close } }, []]
    end
    lint_clean(app) { assert_match(/\r\n\r\npartial\z/, exchange(get)) }
  end

  def test_upgrade_answered_without_hijack
    lint_clean(ServerHelper::HELLO) do
      assert_match(/\AHTTP\/1\.1 200 OK/, exchange("GET / HTTP/1.1\r\nHost: a\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\n"))
    end
  end

  def test_request_target_forms
    app = ->(env) { [200, TEXT.dup, ["#{env['REQUEST_METHOD']} #{env['PATH_INFO']}"]] }
    lint_clean(app) do
      assert_equal "OPTIONS *", exchange_one("OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n")[2]
      assert_equal "GET /x", exchange_one("GET http://a/x?y HTTP/1.1\r\nHost: a\r\n\r\n")[2]
      assert_match(/\r\n\r\nCONNECT a:443\z/, exchange("CONNECT a:443 HTTP/1.1\r\nHost: a:443\r\n\r\n"))
    end
  end

  def test_hosts_lint_accepts_are_served
    app = ->(env) { [200, TEXT.dup, ["#{env['SERVER_NAME']} #{env['SERVER_PORT']}"]] }
    lint_clean(app) do
      assert_equal "[::1] 8080", exchange_one(get("/", "").sub("Host: localhost", "Host: [::1]:8080"))[2]
      assert_equal "a%41b 80", exchange_one(get("/", "").sub("Host: localhost", "Host: a%41b"))[2]
    end
  end

  def test_hosts_lint_refuses_are_400
    lint_clean(ServerHelper::HELLO) do
      ["fuzz%", "%zz", "[:::]", "[1::2::3]", "[::1"].each do |host|
        assert_match(/\AHTTP\/1\.1 400 /, exchange("GET / HTTP/1.1\r\nHost: #{host}\r\n\r\n"), host)
      end
    end
  end

  private

  # One request on a new connection: [status, headers, body].
  def exchange_one(request, head: false)
    socket = connect
    socket.write(request)
    read_response(socket, head: head)
  ensure
    socket&.close
  end
end
