# frozen_string_literal: true

require_relative "server_helper"
require "openssl"
require "tmpdir"

# ssl:// binds: HTTPS through a real OpenSSL client, with a certificate made
# for the test.
class ServerTLSTest < PlainTest
  include ServerHelper

  SCHEME = ->(env) { [200, { "content-type" => "text/plain" }, [env["rack.url_scheme"]]] }

  def setup
    @dir = Dir.mktmpdir("nb-tls")
    TestCertificates.write_self_signed(@dir)
  end

  def teardown
    super
    FileUtils.rm_rf(@dir)
  end

  def cert_path = File.join(@dir, "cert.pem")
  def key_path = File.join(@dir, "key.pem")

  def bind(query = "cert=#{cert_path}&key=#{key_path}")
    "ssl://127.0.0.1:0?#{query}"
  end

  def start_tls(app = SCHEME, **options)
    app = Rack::Lint.new(app)
    @server = NeverBlock::Server.new(app, bind: [bind], workers: 0, **options)
    @port = Integer(@server.bound_addresses.first[/\d+\z/])
    @server_thread = Thread.new { @server.run }
  end

  def https
    http = Net::HTTP.new("127.0.0.1", @port)
    http.use_ssl = true
    http.ca_file = cert_path
    http.verify_mode = OpenSSL::SSL::VERIFY_PEER
    http
  end

  def tls_connect
    context = OpenSSL::SSL::SSLContext.new
    context.ca_file = cert_path
    context.verify_mode = OpenSSL::SSL::VERIFY_PEER
    ssl = OpenSSL::SSL::SSLSocket.new(connect, context)
    ssl.sync_close = true
    ssl.hostname = "127.0.0.1"
    ssl.connect
    ssl
  end

  def test_https_requests_on_one_kept_alive_connection_see_the_https_scheme
    start_tls
    assert_match %r{\Assl://127\.0\.0\.1:\d+\z}, @server.bound_addresses.first
    https.start do |http|
      3.times { assert_equal ["200", "https"], http.get("/").then { |r| [r.code, r.body] } }
    end
  end

  # Bodies larger than a TLS record (16 KiB) and than the read size: bytes
  # OpenSSL has decrypted but not handed out must not be waited for.
  def test_large_request_and_response_bodies
    echo = ->(env) { [200, { "content-type" => "application/octet-stream" }, [env["rack.input"].read.reverse * 5]] }
    start_tls(echo)
    payload = Random.new(1).bytes(300_000)
    response = https.start { |http| http.post("/", payload) }
    assert_equal "200", response.code
    assert_equal payload.reverse * 5, response.body
  end

  def test_pipelined_requests_in_one_tls_write
    start_tls
    ssl = tls_connect
    ssl.write("GET /a HTTP/1.1\r\nHost: x\r\n\r\nGET /b HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = +""
    begin
      answer << ssl.readpartial(65_536) while true # rubocop:disable Style/InfiniteLoop
    rescue EOFError, OpenSSL::SSL::SSLError
      nil
    end
    assert_equal 2, answer.scan("HTTP/1.1 200 OK").size, answer
  ensure
    ssl&.close
  end

  def test_plain_http_on_the_tls_port_is_disconnected_and_the_server_keeps_serving
    start_tls
    log = capture_log do
      answer = exchange("GET / HTTP/1.1\r\nHost: x\r\n\r\n")
      refute_match(/HTTP\/1\.1/, answer)
      assert_equal "https", https.start { |http| http.get("/").body }
    end
    assert_empty log.lines.grep(/ERROR|WARN/)
  end

  # A client that connects and never starts the handshake holds no request
  # slot, and is dropped after header_timeout.
  def test_a_silent_client_holds_no_slot_and_is_dropped_after_the_header_timeout
    start_tls(fiber_pool: 1, header_timeout: 0.5)
    silent = connect
    assert_equal "https", https.start { |http| http.get("/").body }
    assert silent.wait_readable(5), "the silent connection was not closed"
    assert_equal "", read_all(silent, timeout: 5)
  end

  def test_a_hijacking_app_gets_an_encrypting_io
    app = lambda do |env|
      io = env["rack.hijack"].call
      io.write("HTTP/1.1 200 OK\r\nContent-Length: 8\r\nConnection: close\r\n\r\nhijacked")
      io.close
      [200, {}, []]
    end
    @server = NeverBlock::Server.new(app, bind: [bind], workers: 0)
    @port = Integer(@server.bound_addresses.first[/\d+\z/])
    @server_thread = Thread.new { @server.run }
    assert_equal "hijacked", https.start { |http| http.get("/").body }
  end

  def test_bad_tls_settings_are_named_at_start
    {
      "cert=#{cert_path}" => /ssl:\/\/ needs key=PATH/,
      "cert=#{File.join(@dir, 'missing.pem')}&key=#{key_path}" => /cannot read the certificate .*missing\.pem/,
      "cert=#{key_path}&key=#{key_path}" => /holds no PEM certificate/,
      "cert=#{cert_path}&key=#{other_key_path}" => /the key does not go with the certificate/,
      "cert=#{cert_path}&key=#{key_path}&verify=peer" => /unknown TLS parameter\(s\) verify/,
      "cert=#{cert_path}&key=#{key_path}&min_version=SSL3" => /min_version must be one of TLS1_2, TLS1_3/
    }.each do |query, message|
      error = assert_raises(ArgumentError, query) { NeverBlock::Server.new(SCHEME, bind: [bind(query)], workers: 0) }
      assert_match message, error.message
    end
    error = assert_raises(ArgumentError) { NeverBlock::Server.new(SCHEME, bind: ["tcp://127.0.0.1:0?cert=x"], workers: 0) }
    assert_match(/tcp:\/\/ takes no parameters/, error.message)
  end

  private

  def other_key_path
    path = File.join(@dir, "other.pem")
    File.write(path, OpenSSL::PKey::RSA.new(2048).private_to_pem)
    path
  end

  # A head's wait for its TLS record: each byte of a record that never
  # completes wakes the wait, which then waits again only for what is left
  # of header_timeout (it waited the whole timeout again, so a client
  # trickling a record kept its head open for as long as it trickled).
  def test_a_tls_record_trickled_into_a_head_is_cut_at_header_timeout
    start_tls(header_timeout: 2)
    ssl = tls_connect
    ssl.write("GET / HTTP/1.1\r\n") # a head begun, in a record of its own
    raw = ssl.to_io
    raw.write([23, 3, 3, 16_000].pack("CCCn")) # an application-data record of 16,000 bytes: its header
    started = NeverBlock::Clock.now
    closed = nil
    until closed || NeverBlock::Clock.now - started > 20
      sleep 0.3
      begin
        raw.write("x") # a byte of the record, never all of it
      rescue IOError, SystemCallError
        closed = NeverBlock::Clock.now - started
      end
      closed ||= (NeverBlock::Clock.now - started if raw.wait_readable(0) && raw.read_nonblock(1, exception: false).nil?)
    end
    assert closed, "the connection was still open after 20 s of trickling"
    assert_operator closed, :<, 10, "cut at header_timeout (2 s), not by the trickle's end"
  ensure
    raw&.close
  end
end

