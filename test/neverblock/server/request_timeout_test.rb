# frozen_string_literal: true

require_relative "server_helper"
require "open3"
require "fileutils"

# `request_timeout:`: a request still waiting past it is unwound at that
# wait (its ensure clauses run) and answered 503 with Retry-After; the
# server and its other requests go on.
class ServerRequestTimeoutTest < PlainTest
  include ServerHelper

  # Idle keep-alive clients would hold the server's stop for its 1 s grace.
  def teardown
    @sockets&.each { |socket| socket.close unless socket.closed? }
    super
  ensure
    NeverBlock.logger = @logger
  end

  # Sleeps 10 s on /slow (recording that its ensure ran), answers at once
  # elsewhere. The log goes to @log.
  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    @unwound = Queue.new
    unwound = @unwound
    @app = lambda do |env|
      if env["PATH_INFO"] == "/slow"
        begin
          sleep 10
        ensure
          unwound << true
        end
      end
      [200, { "content-type" => "text/plain", "content-length" => "5" }, ["fast\n"]]
    end
  end

  # Queue#pop(timeout:) is Ruby 3.2's: on 3.1 the Hash reads as non_block.
  def pop(queue, timeout: 30)
    Timeout.timeout(timeout) { queue.pop }
  end

  def test_a_request_still_waiting_past_the_timeout_gets_503_with_retry_after_and_a_log_line
    start_server(@app, request_timeout: 0.5)
    socket = connect
    socket.write(get("/slow"))
    status, headers, = nil
    took = elapsed { status, headers, = read_response(socket) }
    assert_equal 503, status
    assert_equal "1", headers["retry-after"]
    assert_equal "close", headers["connection"]
    assert_operator took, :<, 5, "answered after #{took.round(2)} s"
    assert_equal "", read_all(socket), "the connection closes after the 503"
    assert pop(@unwound), "the app's ensure ran"
    assert_equal 1, @server.stats[:requests_timed_out]
    assert_match(%r{WARN .*GET /slow timed out after 0\.\d+ s \(request_timeout 0\.5 s, pid #{Process.pid}\)}, @log.string)
  end

  def test_a_fast_request_on_the_same_server_is_unaffected_and_the_next_connection_is_served
    start_server(@app, request_timeout: 0.5)
    slow = connect
    slow.write(get("/slow"))
    fast = connect
    3.times do # keep-alive: three requests on one connection, while /slow waits
      fast.write(get("/fast"))
      assert_equal [200, "fast\n"], read_response(fast).values_at(0, 2)
    end
    assert_equal 503, read_response(slow).first
    again = connect
    again.write(get("/fast"))
    assert_equal [200, "fast\n"], read_response(again).values_at(0, 2)
    assert_equal 1, @server.stats[:requests_timed_out]
  end

  def test_an_app_that_rescues_the_expiry_and_answers_gets_its_answer_through
    app = lambda do |_env|
      sleep 10
      [200, {}, ["never"]]
    rescue NeverBlock::Server::RequestTimeout => e
      [504, { "content-type" => "text/plain" }, ["gave up: #{e.message}\n"]]
    end
    start_server(app, request_timeout: 0.3)
    socket = connect
    socket.write(get)
    status, _headers, body = read_response(socket)
    assert_equal 504, status
    assert_equal "gave up: request_timeout of 0.3 s expired\n", body
  end

  # The app's own answer does not hide the timeout from the operator: one
  # warning, one count (not two: the answer is written without a deadline).
  def test_an_expiry_the_app_rescued_is_logged_and_counted_once
    app = lambda do |_env|
      sleep 10
      [200, {}, ["never"]]
    rescue NeverBlock::Server::RequestTimeout
      [504, { "content-type" => "text/plain" }, ["gave up\n"]]
    end
    start_server(app, request_timeout: 0.3)
    socket = connect
    socket.write(get("/report"))
    assert_equal 504, read_response(socket).first
    eventually { @server.stats[:requests_timed_out] == 1 }
    lines = @log.string.lines.grep(/timed out/)
    assert_equal 1, lines.size, @log.string
    assert_match(%r{WARN .*GET /report timed out after 0\.\d+ s \(request_timeout 0\.3 s, pid #{Process.pid}\); }, lines.first)
    assert_match(/\); the app rescued the expiry and answered 504$/, lines.first)
    socket.write(get("/report"))
    assert_equal 504, read_response(socket).first, "the connection stays open for the next request"
    eventually { @server.stats[:requests_timed_out] == 2 }
  end

  # The same for a body whose each waited past the deadline and rescued it.
  def test_an_expiry_a_streaming_body_rescued_is_logged_and_counted
    body = Object.new
    def body.each
      yield "first\n"
      sleep 10
    rescue NeverBlock::Server::RequestTimeout
      yield "stopped early\n"
    end
    start_server(->(_env) { [200, { "content-type" => "text/plain" }, body] }, request_timeout: 0.3)
    socket = connect
    socket.write(get)
    status, _headers, text = read_response(socket)
    assert_equal [200, "first\nstopped early\n"], [status, text]
    eventually { @server.stats[:requests_timed_out] == 1 }
    assert_match(%r{GET / timed out after .*; the app rescued the expiry and answered 200}, @log.string)
  end

  # An app that answers past its deadline without waiting was never
  # interrupted: that is not a timeout (nothing to log or count).
  def test_an_answer_computed_past_the_deadline_without_a_wait_is_not_a_timeout
    app = lambda do |_env|
      computed_until = NeverBlock::Clock.now + 0.4
      nil while NeverBlock::Clock.now < computed_until
      [200, { "content-type" => "text/plain" }, ["late\n"]]
    end
    start_server(app, request_timeout: 0.2)
    socket = connect
    socket.write(get)
    assert_equal [200, "late\n"], read_response(socket).values_at(0, 2)
    assert_equal 0, @server.stats[:requests_timed_out]
    refute_match(/timed out/, @log.string)
  end

  # Rails' ShowExceptions renders a 500 page for any exception and says
  # which in env["action_dispatch.exception"]: for the expiry, that page
  # is no answer of the app's, and the client gets the server's 503.
  def test_a_framework_error_page_for_the_expiry_becomes_the_503
    app = lambda do |env|
      sleep 10
      [200, {}, []]
    rescue Exception => e # rubocop:disable Lint/RescueException -- as ShowExceptions does
      env["action_dispatch.exception"] = e
      [500, { "content-type" => "text/html" }, ["<h1>We're sorry, but something went wrong.</h1>"]]
    end
    start_server(app, request_timeout: 0.3)
    socket = connect
    socket.write(get)
    status, headers, = read_response(socket)
    assert_equal 503, status
    assert_equal "1", headers["retry-after"]
    assert_equal 1, @server.stats[:requests_timed_out]
  end

  def test_the_expiry_is_not_a_timeout_error_but_rescue_standard_error_cleanup_sees_it
    seen = Queue.new
    app = lambda do |_env|
      begin
        sleep 10
      rescue Timeout::Error
        seen << :timeout_error # Net::HTTP's retry would take it for its own
      rescue StandardError => e
        seen << e.class
        raise
      end
      [200, {}, []]
    end
    start_server(app, request_timeout: 0.3)
    socket = connect
    socket.write(get)
    assert_equal 503, read_response(socket).first
    assert_equal NeverBlock::Server::RequestTimeout, pop(seen)
  end

  def test_a_body_that_waits_past_the_deadline_before_its_first_chunk_gets_503
    body = Object.new
    def body.each
      sleep 10
      yield "late"
    end
    start_server(->(_env) { [200, { "content-type" => "text/plain" }, body] }, request_timeout: 0.3)
    socket = connect
    socket.write(get)
    assert_equal 503, read_response(socket).first
  end

  def test_a_response_already_started_is_cut_by_closing_the_connection
    body = Object.new
    def body.each
      yield "first\n"
      sleep 10
      yield "never\n"
    end
    start_server(->(_env) { [200, { "content-type" => "text/plain" }, body] }, request_timeout: 0.3)
    socket = connect
    socket.write(get)
    response = read_all(socket)
    assert_match(%r{\AHTTP/1\.1 200 OK\r\n}, response)
    assert_includes response, "first\n"
    refute_includes response, "never"
    refute_includes response, "0\r\n\r\n", "no last chunk: the client sees the response is incomplete"
    assert_equal 1, @server.stats[:requests_timed_out]
  end

  # The response before it on the connection does not count as this one's start.
  def test_a_request_after_another_on_a_keep_alive_connection_still_gets_its_503
    start_server(@app, request_timeout: 0.3)
    socket = connect
    socket.write(get("/fast"))
    assert_equal 200, read_response(socket).first
    socket.write(get("/slow"))
    assert_equal 503, read_response(socket).first
  end

  # Early hints are not the response: a timeout after them still gets a 503.
  def test_a_request_that_sent_early_hints_still_gets_its_503
    app = lambda do |env|
      env["rack.early_hints"].call({ "link" => "</a.css>; rel=preload; as=style" })
      sleep 10
      [200, {}, []]
    end
    start_server(app, request_timeout: 0.3, early_hints: true)
    socket = connect
    socket.write(get)
    assert_equal 103, read_response(socket).first
    assert_equal 503, read_response(socket).first
  end

  # The clock starts at the end of the head: a request that waited its
  # whole time for a request slot is answered 503 without the app. (The
  # one that held the slot waited, then computed past its deadline without
  # waiting: it cannot be interrupted, and its answer is sent.)
  def test_a_request_whose_deadline_passed_while_it_waited_for_a_slot_gets_503_without_the_app
    calls = Queue.new
    app = lambda do |env|
      calls << env["PATH_INFO"]
      if env["PATH_INFO"] == "/busy"
        sleep 0.3
        computed_until = NeverBlock::Clock.now + 0.4
        nil while NeverBlock::Clock.now < computed_until
      end
      [200, { "content-type" => "text/plain" }, ["done\n"]]
    end
    start_server(app, request_timeout: 0.5, fiber_pool: 1, adaptive_limit: false)
    waiting = connect # accepted now: with the one slot taken, the server accepts no more
    eventually { @server.stats[:connections] == 1 }
    busy = connect
    busy.write(get("/busy"))
    assert_equal "/busy", pop(calls)
    waiting.write(get("/waiting"))
    assert_equal 503, read_response(waiting).first
    assert_equal 200, read_response(busy).first
    assert_equal 0, calls.size, "the app was called for the request that waited"
    assert_match(%r{GET /waiting timed out after 0\.\d+ s .* before the app was called}, @log.string)
  end

  # The body's close (where Rails releases its connections) and the
  # response_finished callbacks run, after the deadline, to their end.
  def test_the_body_is_closed_and_response_finished_callbacks_run_with_the_expiry
    finished = Queue.new
    body = Object.new
    body.define_singleton_method(:each) { |&_| sleep 10 }
    body.define_singleton_method(:close) do
      sleep 0.05 # a wait past the deadline: not interrupted
      finished << :closed
    end
    app = lambda do |env|
      env["rack.response_finished"] << ->(_env, status, _headers, error) { finished << [status, error.class] }
      [200, { "content-type" => "text/plain" }, body]
    end
    start_server(app, request_timeout: 0.3, lint: false)
    socket = connect
    socket.write(get)
    assert_equal 503, read_response(socket).first
    assert_equal [:closed, [503, NeverBlock::Server::RequestTimeout]], [pop(finished), pop(finished)]
  end

  def test_a_head_request_gets_503_without_a_body
    start_server(@app, request_timeout: 0.3)
    socket = connect
    socket.write("HEAD /slow HTTP/1.1\r\nHost: a\r\n\r\n")
    status, headers, = read_response(socket, head: true)
    assert_equal 503, status
    assert_equal "", read_all(socket)
    assert_equal "close", headers["connection"]
  end

  def test_off_by_default
    start_server(@app)
    assert_nil @server.limits.request_timeout
  end

  def test_invalid_values_are_refused
    [-1, Float::NAN, Float::INFINITY, "1", 0, true].each do |value|
      error = assert_raises(ArgumentError, value.inspect) do
        NeverBlock::Server.new(@app, bind: "tcp://127.0.0.1:0", workers: 0, request_timeout: value)
      end
      assert_match(/request_timeout/, error.message)
    end
    assert_nil NeverBlock::Server.new(@app, workers: 0, request_timeout: false).limits.request_timeout
  end
end

# Setting it from `neverblock serve` (option and -C file) and rackup, as
# real processes serving test/fixtures/server/pids.ru (`/slow?SECONDS`).
class ServerRequestTimeoutSettingsTest < PlainTest
  include ServerProcess

  EXE = File.expand_path("../../../exe/neverblock", __dir__)
  PIDS_RU = File.expand_path("../../fixtures/server/pids.ru", __dir__)

  def teardown
    super
    FileUtils.rm_rf(@dir) if @dir
  end

  # The server on `port` answers /slow?60 with a 503 well before 60 s (its
  # request_timeout is 0.5 s), and logs it.
  def assert_times_out(port)
    wait_for_answer(port)
    response = nil
    took = elapsed do
      response = Net::HTTP.start("127.0.0.1", port, read_timeout: 90) { |http| http.get("/slow?60") }
    end
    assert_equal "503", response.code
    assert_equal "1", response["retry-after"]
    assert_operator took, :<, 20
    eventually { output.include?("GET /slow timed out after") }
  end

  def failure_context = "; output:\n#{output}"

  def test_neverblock_serve_request_timeout
    port = free_port
    start(RbConfig.ruby, EXE, "serve", PIDS_RU, "-b", "tcp://127.0.0.1:#{port}", "-w", "0", "--request-timeout", "0.5")
    assert_times_out(port)
  end

  def test_a_config_file_request_timeout
    require "tmpdir"
    @dir = Dir.mktmpdir("nb-rt")
    File.write(File.join(@dir, "neverblock.rb"), "workers 0\nrequest_timeout 0.5\n")
    port = free_port
    start(RbConfig.ruby, EXE, "serve", PIDS_RU, "-b", "tcp://127.0.0.1:#{port}", "-C", File.join(@dir, "neverblock.rb"))
    assert_times_out(port)
  end

  def test_rackup_o_request_timeout
    port = free_port
    start(RbConfig.ruby, Gem.bin_path("rackup", "rackup"), "-s", "neverblock", "-o", "127.0.0.1", "-p", port.to_s,
          "-E", "none", "-O", "RequestTimeout=0.5", PIDS_RU)
    assert_times_out(port)
  end

  def test_invalid_values_are_usage_errors
    { "-1" => /request_timeout must be a finite number of seconds >= 0, got -1\.0/,
      "0" => /request_timeout must be > 0 seconds/,
      "soon" => /invalid argument: --request-timeout soon/ }.each do |value, message|
      out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", PIDS_RU, "-b", "tcp://127.0.0.1:0", "-w", "0",
                                    "--request-timeout", value)
      assert_equal 64, status.exitstatus, out
      assert_match message, out
    end
  end
end
