# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"
require "neverblock/reverse_proxy"
require "net/http"
require "stringio"
require "rack"
require_relative "../../support/read_log"

# NeverBlock::ReverseProxy against real upstreams: a NeverBlock::Server app,
# and raw TCP servers that misbehave on purpose.
class ReverseProxyTest < PlainTest
  ECHO = lambda do |env|
    body = env["rack.input"].read
    headers = { "content-type" => "text/plain", "set-cookie" => %w[a=1 b=2],
                "x-seen" => env.select { |k, _| k.start_with?("HTTP_") }.map { |k, v| "#{k}=#{v}" }.sort.join(";"),
                "x-target" => "#{env['REQUEST_METHOD']} #{env['PATH_INFO']}?#{env['QUERY_STRING']}" }
    return [200, headers, StreamBody.new] if env["PATH_INFO"] == "/stream"

    sleep(Float(env["QUERY_STRING"])) if env["PATH_INFO"] == "/sleep"
    [200, headers, ["#{body.bytesize}:#{body[0, 20]}"]]
  end

  # A streamed (chunked) upstream body.
  class StreamBody
    def each
      3.times do |i|
        yield "part#{i};"
        sleep 0.01
      end
    end
  end

  def setup
    @servers = []
    @threads = []
    @raw = []
  end

  def teardown
    @servers.each(&:stop)
    @raw.each { |server| server.close unless server.closed? }
    @threads.each { |thread| thread.join(10) }
    super
  end

  def start(app)
    server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0)
    address = server.bound_addresses.first
    @servers << server
    @threads << Thread.new { server.run }
    address.sub("tcp://", "http://")
  end

  # Upstream ECHO, and a NeverBlock::Server running the proxy in front of it.
  def proxied(app = ECHO, **options)
    @proxy = NeverBlock::ReverseProxy.new(start(app), **options)
    URI(start(@proxy))
  end

  def env_for(method, path, body: nil, headers: {})
    { "REQUEST_METHOD" => method, "SCRIPT_NAME" => "", "PATH_INFO" => path, "QUERY_STRING" => "",
      "SERVER_NAME" => "front", "rack.url_scheme" => "http", "REMOTE_ADDR" => "10.0.0.1",
      "rack.input" => StringIO.new(body.to_s.b) }.merge(headers)
  end

  # A raw upstream: the block gets each accepted socket (in a thread).
  def raw_upstream(&handler)
    server = TCPServer.new("127.0.0.1", 0)
    @raw << server
    @threads << Thread.new do
      loop do
        client = server.accept
        Thread.new(client) do |socket|
          handler.call(socket)
        rescue IOError, SystemCallError
          nil
        ensure
          socket.close unless socket.closed?
        end
      end
    rescue IOError, SystemCallError
      nil
    end
    "http://127.0.0.1:#{server.addr[1]}"
  end

  def read_request(socket)
    head = +""
    head << socket.readpartial(4096) until head.include?("\r\n\r\n")
    head
  end

  def call(proxy, env)
    status, headers, body = proxy.call(env)
    text = +""
    body.each { |chunk| text << chunk }
    [status, headers, text]
  ensure
    body.close if body.respond_to?(:close)
  end

  def test_forwards_method_target_headers_and_body_and_returns_every_header
    uri = proxied
    Net::HTTP.start(uri.host, uri.port) do |http|
      response = http.get("/a/b?z=1&y=2", "X-Custom" => "yes", "Connection" => "keep-alive, X-Drop", "X-Drop" => "no")
      assert_equal "200", response.code
      assert_equal "GET /a/b?z=1&y=2", response["x-target"]
      assert_equal %w[a=1 b=2], response.get_fields("set-cookie")
      seen = response["x-seen"]
      assert_includes seen, "HTTP_X_CUSTOM=yes"
      assert_includes seen, "HTTP_X_FORWARDED_FOR=127.0.0.1"
      assert_includes seen, "HTTP_X_FORWARDED_PROTO=http"
      assert_includes seen, "HTTP_HOST=#{URI(@proxy.upstream.to_s).host}:#{@proxy.upstream.port}"
      refute_includes seen, "HTTP_X_DROP", "a header named by Connection is hop-by-hop"
      refute_includes seen, "HTTP_CONNECTION=keep-alive, X-Drop"

      response = http.post("/p", "x" * 100_000, "content-type" => "application/octet-stream")
      assert_equal "100000:#{'x' * 20}", response.body
      response = http.head("/h")
      assert_equal "200", response.code
      assert_nil response.body
    end
  end

  SPOOFED = { "HTTP_HOST" => "site.example", "REMOTE_ADDR" => "203.0.113.9",
              "HTTP_FORWARDED" => "for=6.6.6.6;proto=https;host=evil.example",
              "HTTP_X_FORWARDED_FOR" => "6.6.6.6", "HTTP_X_FORWARDED_HOST" => "evil.example",
              "HTTP_X_FORWARDED_PROTO" => "https" }.freeze

  # The upstream's view through Rack::Request (which reads Forwarded first),
  # and the forwarding headers it got.
  def forwarding_upstream
    seen = {}
    url = start(lambda do |env|
      seen.replace(env.slice("HTTP_FORWARDED", "HTTP_X_FORWARDED_FOR", "HTTP_X_FORWARDED_HOST", "HTTP_X_FORWARDED_PROTO"))
      request = Rack::Request.new(env)
      [200, { "content-type" => "text/plain" }, ["#{request.ip} #{request.scheme}://#{request.host}"]]
    end)
    [url, seen]
  end

  def test_a_client_cannot_name_its_address_host_or_scheme_through_forwarding_headers
    upstream, seen = forwarding_upstream
    proxy = NeverBlock::ReverseProxy.new(upstream)

    assert_equal [200, "203.0.113.9 http://site.example"], call(proxy, env_for("GET", "/", headers: SPOOFED)).values_at(0, 2)
    assert_equal({ "HTTP_X_FORWARDED_FOR" => "203.0.113.9", "HTTP_X_FORWARDED_HOST" => "site.example",
                   "HTTP_X_FORWARDED_PROTO" => "http" }, seen)
  end

  def test_behind_a_trusted_proxy_forwarding_headers_go_on_with_this_hop_appended
    upstream, seen = forwarding_upstream
    proxy = NeverBlock::ReverseProxy.new(upstream, trust_forwarded: true)

    assert_equal 200, call(proxy, env_for("GET", "/", headers: SPOOFED))[0]
    assert_equal "6.6.6.6, 203.0.113.9", seen["HTTP_X_FORWARDED_FOR"]
    assert_equal "evil.example", seen["HTTP_X_FORWARDED_HOST"]
    assert_equal 'for=6.6.6.6;proto=https;host=evil.example, for=203.0.113.9;host="evil.example";proto=https',
                 seen["HTTP_FORWARDED"]
  end

  # Connection names headers in any case, with blanks around the commas,
  # and `_` for `-` (Rack's env has `_` for both); thousands of names are
  # each looked up once, not searched for every header.
  def test_the_headers_a_client_connection_names_do_not_go_upstream
    proxy = NeverBlock::ReverseProxy.new("http://127.0.0.1:9")
    many = Array.new(5_000) { |i| "x-n#{i}" }.join(",")
    env = env_for("GET", "/", headers: { "HTTP_CONNECTION" => "keep-alive, X-Drop ,x_other,#{many}", "HTTP_X_DROP" => "1",
                                          "HTTP_X_OTHER" => "2", "HTTP_X_KEEP" => "3", "HTTP_X_N4999" => "4" })
    head = proxy.send(:request_head, env)
    assert_includes head, "x-keep: 3\r\n"
    refute_match(/^(x-drop|x-other|x-n4999|connection):/i, head)
  end

  # An upstream that sends Connection twice: its value is an Array, every
  # name in both counts.
  def test_the_headers_an_upstream_connection_names_do_not_come_back
    proxy = NeverBlock::ReverseProxy.new("http://127.0.0.1:9")
    headers = { "connection" => ["close", "X-Secret"], "x-secret" => "s", "x-kept" => "k", "keep-alive" => "1" }
    assert_equal({ "x-kept" => "k" }, proxy.send(:response_headers, headers))
  end

  def test_a_chunked_request_body_is_sent_chunked
    proxy = NeverBlock::ReverseProxy.new(start(ECHO))
    status, _headers, body = call(proxy, env_for("POST", "/c", body: "hello world"))
    assert_equal 200, status
    assert_equal "11:hello world", body
  end

  def test_streams_a_chunked_upstream_response
    uri = proxied
    response = Net::HTTP.get_response(URI("#{uri}/stream"))
    assert_equal "part0;part1;part2;", response.body
  end

  def test_reuses_keep_alive_connections
    connections = 0
    upstream = raw_upstream do |socket|
      connections += 1
      loop do
        read_request(socket)
        socket.write("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
      end
    end
    proxy = NeverBlock::ReverseProxy.new(upstream, pool_size: 2)
    10.times { assert_equal [200, "ok"], call(proxy, env_for("GET", "/")).values_at(0, 2) }
    assert_equal 1, connections
    assert_equal 1, proxy.stats[:idle]
  end

  # Its answer cannot have come when the request is just written: the
  # proxy waits for it, and reads once bytes are there.
  def test_the_upstream_is_read_once_its_answer_has_come
    upstream = raw_upstream do |socket|
      loop do
        read_request(socket)
        sleep 0.05
        socket.write("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
      end
    end
    proxy = NeverBlock::ReverseProxy.new(upstream, pool_size: 1)
    assert_equal [200, "ok"], call(proxy, env_for("GET", "/")).values_at(0, 2)
    port = Integer(upstream[/\d+\z/])
    socket = ObjectSpace.each_object(NeverBlock::ReverseProxy::UpstreamConnection).map { |c| c.instance_variable_get(:@socket) }
                        .find { |candidate| !candidate.closed? && candidate.remote_address.ip_port == port }
    log = ReadLog.on(socket || flunk("no connection to the upstream's port #{port}"))
    assert_equal [200, "ok"], call(proxy, env_for("GET", "/")).values_at(0, 2)
    reads = log.read_log.reject { |length, _| length == 1 } # (the health check's peek before the connection is lent)
    assert_equal [:bytes], reads.map(&:last)
  end

  def test_a_get_on_a_connection_the_upstream_closed_meanwhile_is_retried_on_a_new_one
    connections = 0
    upstream = raw_upstream do |socket|
      connections += 1
      read_request(socket)
      # Keep-alive promised, then the connection closes after this one response.
      socket.write("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
      socket.close_write
      sleep 0.2
    end
    proxy = NeverBlock::ReverseProxy.new(upstream)
    assert_equal 200, call(proxy, env_for("GET", "/"))[0]
    sleep 0.05 # the upstream's FIN arrives; the idle check sees it
    assert_equal [200, "ok"], call(proxy, env_for("GET", "/")).values_at(0, 2)
    assert_equal 2, connections
  end

  def test_refused_connection_is_a_502
    port = TCPServer.new("127.0.0.1", 0).then { |s| s.addr[1].tap { s.close } }
    proxy = NeverBlock::ReverseProxy.new("http://127.0.0.1:#{port}")
    log = capture_log { @result = call(proxy, env_for("GET", "/")) }
    status, headers, body = @result
    assert_equal 502, status
    assert_equal "unavailable", headers["x-upstream-error"]
    assert_equal "502 upstream unavailable\n", body
    assert_match(/ECONNREFUSED/, log)
  end

  def test_an_upstream_that_closes_without_answering_is_a_502
    upstream = raw_upstream { |socket| read_request(socket) }
    proxy = NeverBlock::ReverseProxy.new(upstream)
    capture_log { assert_equal 502, call(proxy, env_for("GET", "/"))[0] }
  end

  def test_garbage_from_the_upstream_is_a_502
    upstream = raw_upstream do |socket|
      read_request(socket)
      socket.write("SMTP ready\r\n\r\n")
      sleep 0.2
    end
    proxy = NeverBlock::ReverseProxy.new(upstream)
    capture_log { assert_equal 502, call(proxy, env_for("GET", "/"))[0] }
    assert_equal 0, proxy.stats[:idle], "the broken connection is not pooled"
  end

  def test_bytes_after_a_complete_response_are_not_part_of_it_and_the_connection_is_not_reused
    upstream = raw_upstream do |socket|
      read_request(socket)
      # One write: a response, then another nobody asked for (an upstream app
      # whose Content-Length was too small, reflecting its input).
      socket.write("HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" \
                   "HTTP/1.1 200 OK\r\ncontent-length: 8\r\nx-injected: 1\r\n\r\nsmuggled")
      sleep 0.5
    end
    proxy = NeverBlock::ReverseProxy.new(upstream)
    status, headers, body = call(proxy, env_for("GET", "/"))
    assert_equal [200, "2", "ok"], [status, headers["content-length"], body]
    refute headers.key?("x-injected")
    assert_equal 0, proxy.stats[:idle], "a connection with stray bytes is not pooled"
  end

  def test_a_slow_upstream_is_a_504
    upstream = raw_upstream do |socket|
      read_request(socket)
      sleep 2
    end
    proxy = NeverBlock::ReverseProxy.new(upstream, timeout: 0.2)
    took = elapsed { capture_log { assert_equal 504, call(proxy, env_for("GET", "/"))[0] } }
    assert_operator took, :<, 1.5
  end

  def test_a_body_closed_before_its_end_closes_the_connection
    upstream = raw_upstream do |socket|
      read_request(socket)
      socket.write("HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n#{'y' * 100_000}")
      sleep 0.5
    end
    proxy = NeverBlock::ReverseProxy.new(upstream)
    _status, _headers, body = proxy.call(env_for("GET", "/"))
    body.close
    assert_equal({ size: 64, in_use: 0, idle: 0, waiting: 0 }, proxy.stats)
  end

  def test_many_concurrent_requests_share_a_small_pool_inside_neverblock
    upstream = start(->(_env) { sleep 0.1; [200, { "content-type" => "text/plain" }, ["ok"]] })
    proxy = NeverBlock::ReverseProxy.new(upstream, pool_size: 8)
    results = nil
    took = elapsed do
      NeverBlock.run do
        results = NeverBlock.map(1..80, concurrency: 80) { call(proxy, env_for("GET", "/")).values_at(0, 2) }
      end
    end
    assert_equal [[200, "ok"]], results.uniq
    assert_operator took, :<, 5, "80 requests of 0.1 s over 8 connections (~1 s)"
    assert_operator proxy.stats[:idle], :<=, 8
  end

  def test_rejects_a_non_http_upstream
    assert_raises(ArgumentError) { NeverBlock::ReverseProxy.new("https://example.com") }
    assert_raises(ArgumentError) { NeverBlock::ReverseProxy.new("ftp://example.com") }
  end
end
