# frozen_string_literal: true

require_relative "server_helper"

# Requests the server refuses: each gets its status and a closed connection,
# and the app never sees it.
class ServerLimitsTest < PlainTest
  include ServerHelper

  def setup
    @calls = Queue.new
    calls = @calls
    @app = lambda do |env|
      calls << env["PATH_INFO"]
      body = env["rack.input"].read
      [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]]
    end
  end

  # Sends `raw`, expects `status` and the connection closed, and the app not called.
  def assert_refused(status, raw, app_calls: 0)
    response = exchange(raw)
    assert_match(%r{\AHTTP/1\.1 #{status} }, response[-(response.size - response.rindex("HTTP/1.1"))..] || "")
    assert_includes response, "connection: close\r\n"
    assert_equal app_calls, @calls.size
    response
  end

  # Sends `raw` in two writes, split at byte `split`, with a pause between.
  def exchange_in_two_reads(raw, split)
    client = connect
    client.write(raw.byteslice(0, split))
    sleep 0.02
    client.write(raw.byteslice(split..))
    read_all(client)
  ensure
    client&.close
  end

  def test_request_target_over_the_limit_is_414
    start_server(@app)
    assert_refused 414, "GET /#{'a' * 9000} HTTP/1.1\r\nHost: a\r\n\r\n"
  end

  def test_request_target_limit_is_configurable
    start_server(@app, max_request_target: 100)
    assert_refused 414, "GET /#{'a' * 101} HTTP/1.1\r\nHost: a\r\n\r\n"
  end

  def test_header_block_over_64_kib_is_431
    start_server(@app)
    headers = 40.times.map { |i| "X-Big-#{i}: #{'v' * 2000}\r\n" }.join
    assert_refused 431, "GET / HTTP/1.1\r\nHost: a\r\n#{headers}\r\n"
  end

  def test_more_than_100_headers_is_431
    start_server(@app)
    headers = 101.times.map { |i| "X-H#{i}: v\r\n" }.join
    assert_refused 431, "GET / HTTP/1.1\r\n#{headers}Host: a\r\n\r\n"
  end

  def test_100_headers_are_fine
    start_server(@app)
    headers = 98.times.map { |i| "X-H#{i}: v\r\n" }.join # + Host + Connection = 100
    response = exchange("GET / HTTP/1.1\r\nHost: a\r\n#{headers}Connection: close\r\n\r\n")
    assert_match(/\AHTTP\/1\.1 200 /, response)
  end

  def test_content_length_over_the_body_limit_is_413_without_reading_it
    start_server(@app, max_body: 1000)
    assert_refused 413, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1001\r\n\r\n"
  end

  # An upload over max_body is no mystery in the log: one line names the
  # limit and how to raise it; more of the same status within a second are
  # counted into the next line, not each logged.
  def test_a_refused_request_logs_one_line_naming_the_limit_and_floods_are_counted
    start_server(@app, max_body: 1000)
    raw = "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1001\r\n\r\n"
    log = capture_log do
      assert_refused 413, raw
      3.times { exchange(raw) }
    end
    lines = log.lines
    assert_equal 1, lines.size, log
    assert_match(%r{refused a request from 127\.0\.0\.1 with 413: Content-Length 1001 over 1000; to raise the limit: --max-body BYTES, or limits max_body: in config/neverblock\.rb \(rails server\), a -C file \(neverblock serve\) or Server\.new}, lines.first)
    sleep NeverBlock::Server::RefusalLog::INTERVAL # the next refusal, a second later, is logged with the count
    log = capture_log { exchange(raw) }
    assert_match(/with 413: .* \(and 3 more 413s since the last line for it\)$/, log)
  end

  def test_content_length_over_the_limit_with_expect_gets_413_not_100
    start_server(@app, max_body: 1000)
    response = assert_refused 413, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
    refute_includes response, "100 Continue"
  end

  def test_chunked_body_over_the_limit_is_413
    start_server(@app, max_body: 1000)
    chunk = "#{'x' * 600}"
    assert_refused 413, "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" \
                        "258\r\n#{chunk}\r\n258\r\n#{chunk}\r\n0\r\n\r\n"
  end

  def test_default_body_limit_is_10_mib
    assert_equal 10 * 1024 * 1024, NeverBlock::Server::Limits.build({}).max_body
  end

  def test_default_max_body_in_memory_is_64_kib
    assert_equal 64 * 1024, NeverBlock::Server::Limits.build({}).max_body_in_memory
  end

  def test_default_max_connections_leaves_file_descriptors_to_the_app
    soft, = Process.getrlimit(:NOFILE)
    max = NeverBlock::Server::Limits.build({}).max_connections
    assert_operator max, :<=, 16_384
    assert_operator max, :<=, soft - 128 if soft > 128
    assert_raises(ArgumentError) { NeverBlock::Server::Limits.build(max_connections: 0) }
  end

  def test_slow_headers_are_408
    start_server(@app, header_timeout: 0.3)
    socket = connect
    socket.write("GET / HTTP/1.1\r\nHost: a\r\n")
    response = read_all(socket)
    assert_match(/\AHTTP\/1\.1 408 /, response)
    assert_equal 0, @calls.size
  end

  def test_slow_body_is_408
    start_server(@app, body_timeout: 0.3)
    socket = connect
    socket.write("POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc")
    response = read_all(socket)
    assert_match(/\AHTTP\/1\.1 408 /, response)
    assert_equal 0, @calls.size
  end

  def test_idle_keep_alive_connection_is_closed_without_a_response
    start_server(@app, idle_timeout: 0.3)
    socket = connect
    socket.write(get)
    assert_equal 200, read_response(socket)[0]
    assert_equal "", read_all(socket)
  end

  def test_a_connection_that_never_sends_is_closed_after_the_idle_timeout
    start_server(@app, idle_timeout: 0.3)
    assert_equal "", read_all(connect)
  end

  # Idle waits have no timer each: the server's IdleSweeper ends them, no
  # sooner than idle_timeout and within a sweep interval after it.
  def test_an_idle_keep_alive_connection_closes_after_the_idle_timeout_not_before
    start_server(@app, idle_timeout: 0.3)
    socket = connect
    socket.write(get)
    assert_equal 200, read_response(socket)[0]
    started = NeverBlock::Clock.now
    assert_equal "", read_all(socket)
    waited = NeverBlock::Clock.now - started
    assert_operator waited, :>=, 0.25
    assert_operator waited, :<, 5 # an order of magnitude past the timeout and its sweep, for a loaded machine's pauses
  end

  # Each request starts the idle wait afresh: a connection that keeps
  # sending within idle_timeout stays open however long it lives.
  # (Gaps of a sixth of the timeout: a loaded machine's pause of a second or
  # two between a response and the next request must not pass for idleness.)
  def test_a_connection_that_sends_within_the_idle_timeout_each_time_stays_open
    start_server(@app, idle_timeout: 3)
    socket = connect
    8.times do
      socket.write(get)
      assert_equal 200, read_response(socket)[0]
      sleep 0.5
    end
    socket.write(get)
    assert_equal 200, read_response(socket)[0], "still open after 4 s of requests 0.5 s apart"
  end

  def test_the_idle_sweep_interval_follows_the_idle_timeout_within_bounds
    assert_in_delta 0.5, NeverBlock::Server::IdleSweeper.new(5).interval, 1e-9
    assert_in_delta 0.0375, NeverBlock::Server::IdleSweeper.new(0.3).interval, 1e-9
    assert_in_delta 0.005, NeverBlock::Server::IdleSweeper.new(0.01).interval, 1e-9
  end

  # --- Request smuggling shapes: 400 and close --------------------------------

  def test_content_length_with_transfer_encoding_is_400
    start_server(@app)
    assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n" \
                        "0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"
  end

  def test_transfer_encoding_with_content_length_is_400
    start_server(@app)
    assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n"
  end

  def test_duplicate_content_length_is_400
    start_server(@app)
    assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello"
  end

  def test_differing_content_lengths_are_400
    start_server(@app)
    assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!"
  end

  def test_invalid_content_length_is_400
    start_server(@app)
    ["abc", "-1", "+5", "1 2", "5, 5"].each do |value|
      assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: #{value}\r\n\r\nhello"
    end
  end

  def test_invalid_chunk_size_is_400
    start_server(@app)
    assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n"
  end

  def test_transfer_encoding_not_ending_in_chunked_is_400
    start_server(@app)
    assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked, gzip\r\n\r\n0\r\n\r\n"
  end

  def test_bare_lf_inside_a_header_value_is_400
    start_server(@app)
    assert_refused 400, "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\nX-B: c\r\n\r\n"
  end

  def test_bare_cr_inside_a_header_value_is_400
    start_server(@app)
    assert_refused 400, "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\rX-B: c\r\n\r\n"
  end

  def test_bare_lf_line_endings_in_headers_are_400
    start_server(@app)
    assert_refused 400, "GET / HTTP/1.1\r\nHost: a\nX-A: b\n\n"
  end

  def test_obs_fold_continuation_lines_are_400
    start_server(@app)
    assert_refused 400, "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n c\r\n\r\n"
    assert_refused 400, "GET / HTTP/1.1\r\nHost: a\r\nX-A: b\r\n\tc\r\n\r\n"
    assert_refused 400, "GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n chunked\r\n\r\n0\r\n\r\n"
  end

  # The fold must be told apart from a value split across reads, at every split point.
  def test_obs_fold_is_400_and_a_plain_head_is_served_wherever_the_reads_split
    start_server(@app)
    plain = "GET / HTTP/1.1\r\nHost: a\r\nX-A: hello world\r\nConnection: close\r\n\r\n"
    folded = "GET / HTTP/1.1\r\nHost: a\r\nX-A: hello\r\n world\r\nConnection: close\r\n\r\n"
    (20...plain.size).step(3) do |split|
      assert_match(%r{\AHTTP/1\.1 200 }, exchange_in_two_reads(plain, split), "split at #{split}")
    end
    (20...folded.size).step(3) do |split|
      assert_match(%r{\AHTTP/1\.1 400 }, exchange_in_two_reads(folded, split), "split at #{split}")
    end
  end

  def test_nul_in_the_target_is_400
    start_server(@app)
    assert_refused 400, "GET /a\0b HTTP/1.1\r\nHost: a\r\n\r\n"
  end

  def test_space_before_the_colon_is_400
    start_server(@app)
    assert_refused 400, "GET / HTTP/1.1\r\nHost : a\r\n\r\n"
    assert_refused 400, "POST / HTTP/1.1\r\nHost: a\r\nContent-Length : 5\r\n\r\nhello"
  end

  def test_http_11_without_host_is_400
    start_server(@app)
    assert_refused 400, "GET / HTTP/1.1\r\n\r\n"
  end

  def test_invalid_host_is_400
    start_server(@app)
    assert_refused 400, "GET / HTTP/1.1\r\nHost: a b\r\n\r\n"
  end

  def test_unknown_method_is_400
    start_server(@app)
    assert_refused 400, "FOO / HTTP/1.1\r\nHost: a\r\n\r\n"
  end

  def test_http_2_request_line_is_505
    start_server(@app)
    assert_refused 505, "GET / HTTP/2.0\r\nHost: a\r\n\r\n"
  end

  def test_garbage_after_a_valid_request_answers_the_valid_one_then_400
    start_server(@app)
    response = exchange("GET /ok HTTP/1.1\r\nHost: a\r\n\r\nthis is not http\r\n\r\n")
    assert_match(%r{\AHTTP/1\.1 200 .*HTTP/1\.1 400 }m, response)
    assert_equal ["/ok"], [@calls.pop]
  end

  def test_header_names_with_underscores_are_dropped
    app = ->(env) { [200, { "content-length" => "0", "x-seen" => env.key?("HTTP_X_A").to_s }, []] }
    start_server(app)
    response = exchange("GET / HTTP/1.1\r\nHost: a\r\nX_A: spoof\r\nConnection: close\r\n\r\n")
    assert_includes response, "x-seen: false"
    assert_includes response, "connection: close" # the next header was read intact
  end

  def test_unknown_options_are_refused
    error = assert_raises(ArgumentError) { NeverBlock::Server.new(@app, max_bdy: 1) }
    assert_match(/max_bdy/, error.message)
  end

  def test_llhttp_missing_says_to_add_the_gem
    out, _err, status = run_ruby(<<~RUBY)
      module Kernel
        alias_method :original_require, :require
        def require(name)
          raise LoadError, "cannot load such file -- llhttp" if name == "llhttp"
          original_require(name)
        end
      end
      begin
        require "neverblock/server"
      rescue LoadError => e
        puts e.message
      end
    RUBY
    assert status.success?
    assert_match(/add `gem "llhttp"/, out)
  end
end
