# frozen_string_literal: true

require_relative "server_helper"
require "logger"
require "json"

class ServerAccessLogTest < PlainTest
  include ServerHelper

  LINE = %r{\A127\.0\.0\.1 - - \[\d{2}/\w{3}/\d{4}:\d{2}:\d{2}:\d{2} [+-]\d{4}\] "(?<request>[^"]*)" (?<status>\d{3}) (?<bytes>\d+|-) (?<seconds>\d+\.\d{4})\n\z}

  # Lines appear just after the response is sent: wait for them.
  def log_lines(io, count)
    eventually { io.string.lines.size >= count }
    io.string.lines
  end

  def test_off_by_default
    assert_nil NeverBlock::Server.new(ServerHelper::HELLO, workers: 0).access_log
    assert_nil NeverBlock::Server.new(ServerHelper::HELLO, workers: 0, access_log: false).access_log
  end

  def test_one_common_log_line_per_request_with_the_duration
    log = StringIO.new
    start_server(access_log: log)
    socket = connect
    socket.write(get("/path?q=1") + get("/other"))
    2.times { read_response(socket) }
    first, second = log_lines(log, 2)
    match = LINE.match(first)
    assert match, first
    assert_equal ["GET /path?q=1 HTTP/1.1", "200", "6"], match.values_at(:request, :status, :bytes)
    assert_operator Float(match[:seconds]), :<, 10
    assert_equal "GET /other HTTP/1.1", LINE.match(second)[:request]
  end

  def test_streamed_head_and_failed_requests_log_their_status_and_body_bytes
    log = StringIO.new
    app = lambda do |env|
      case env["PATH_INFO"]
      when "/each" then [200, {}, %w[abc defg].each]
      when "/call" then [201, {}, ->(stream) { stream.write("12345"); stream.close }]
      when "/fail" then raise "app failure"
      else ServerHelper::HELLO.call(env)
      end
    end
    capture_log do
      start_server(app, access_log: log)
      socket = connect
      socket.write(get("/each") + get("/call") + "HEAD / HTTP/1.1\r\nHost: a\r\n\r\n" + get("/fail"))
      read_response(socket)
      read_response(socket)
      read_response(socket, head: true)
      read_response(socket)
    end
    lines = log_lines(log, 4).map { |line| LINE.match(line).values_at(:request, :status, :bytes) }
    assert_equal [["GET /each HTTP/1.1", "200", "7"], ["GET /call HTTP/1.1", "201", "5"],
                  ["HEAD / HTTP/1.1", "200", "0"], ["GET /fail HTTP/1.1", "500", "22"]], lines
  end

  def test_a_logger_gets_the_bare_line
    io = StringIO.new
    start_server(access_log: Logger.new(io))
    exchange(get("/", "Connection: close\r\n"))
    line = log_lines(io, 1).last
    assert_match LINE, line, "no Logger prefix"
  end

  def test_true_logs_to_stdout
    out = StringIO.new
    previous = $stdout
    $stdout = out
    begin
      start_server(access_log: true)
    ensure
      $stdout = previous
    end
    exchange(get("/stdout", "Connection: close\r\n"))
    assert_match(%r{"GET /stdout HTTP/1\.1" 200 6 }, log_lines(out, 1).first)
  end

  def test_a_failing_log_never_fails_requests_and_is_reported_once
    broken = Object.new
    def broken.<<(_line)
      raise IOError, "disk full"
    end
    log = capture_log do
      start_server(access_log: broken)
      socket = connect
      2.times do # two batches: both fail, one report
        3.times do
          socket.write(get)
          assert_equal [200, "hello\n"], read_response(socket).values_at(0, 2)
        end
        sleep NeverBlock::Server::AccessLog::FLUSH_AFTER * 4 # the batch is written, and fails
      end
    end
    assert_equal 1, log.scan("the access log failed (IOError: disk full)").size, log
  end

  def test_quotes_and_control_bytes_in_the_request_line_are_escaped
    access_log = NeverBlock::Server::AccessLog.new(StringIO.new)
    env = { "REQUEST_METHOD" => "GET", "PATH_INFO" => "/a\"b\\", "QUERY_STRING" => "x=\xff".b,
            "SERVER_PROTOCOL" => "HTTP/1.1" }
    assert_equal 'GET /a\x22b\x5C?x=\xFF HTTP/1.1', access_log.request_line(env)
  end

  # Written out by hand (not JSON.generate): every string JSON must escape,
  # and bytes that are not UTF-8 (a raw request target), still make a line
  # JSON parses back.
  def test_json_lines_escape_what_json_must_and_survive_bytes_that_are_not_utf8
    io = StringIO.new
    access_log = NeverBlock::Server::AccessLog.new(io, format: :json)
    path = "/q\"uote\\back\tslash\u00e9\u2028"
    env = { "REQUEST_METHOD" => "GET", "PATH_INFO" => path, "QUERY_STRING" => "x=\xff\x01".b, "HTTP_X_REQUEST_ID" => "id-1" }
    access_log.write("::1", access_log.start(env), 404, "-", 1.5e-05, 0.25)
    entry = JSON.parse(io.string)
    assert_equal [path, "x=\uFFFD\u0001", "id-1", "::1", 404, nil, 1.5e-05, 0.25],
                 entry.values_at("path", "query", "id", "remote", "status", "bytes", "duration", "admission_wait")
    assert io.string.end_with?("}\n")
  end

  # JSON lines: one object per request with its id (the client's, kept, or
  # a new one the app sees too), the admission wait and a front proxy's
  # queue time.
  def test_json_lines_carry_the_request_id_the_app_sees_and_the_queue_time
    log = StringIO.new
    seen = []
    app = lambda do |env|
      seen << env["HTTP_X_REQUEST_ID"]
      [200, { "content-type" => "text/plain" }, ["ok"]]
    end
    start_server(app, access_log: log, access_log_format: :json)
    socket = connect
    start = format("t=%.3f", Time.now.to_f - 0.25)
    socket.write("GET /a?b=1 HTTP/1.1\r\nHost: x\r\nX-Request-Id: abc-123.X_y\r\nX-Request-Start: #{start}\r\n\r\n" \
                 "GET /c HTTP/1.1\r\nHost: x\r\nX-Request-Id: not valid!\r\n\r\n" + get("/d"))
    3.times { read_response(socket) }
    first, second, third = log_lines(log, 3).map { |line| JSON.parse(line) }
    assert_equal({ "id" => "abc-123.X_y", "remote" => "127.0.0.1", "method" => "GET", "path" => "/a", "query" => "b=1",
                   "status" => 200, "bytes" => 2, "worker" => nil },
                 first.slice("id", "remote", "method", "path", "query", "status", "bytes", "worker"))
    assert_in_delta 0.25, first["queue_time"], 0.2
    assert_kind_of Float, first["duration"]
    assert_equal 0.0, first["admission_wait"]
    assert_match(/\A\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z\z/, first["time"])
    uuid = /\A\h{8}-\h{4}-\h{4}-\h{4}-\h{12}\z/
    assert_match uuid, second["id"], "an invalid id is replaced"
    assert_match uuid, third["id"], "a missing one is made"
    assert_nil third["queue_time"]
    assert_equal [first["id"], second["id"], third["id"]], seen, "the app sees the id the log has"
  end

  def test_a_custom_formatter_gets_each_entry
    log = StringIO.new
    start_server(access_log: log, access_log_format: ->(entry) { "#{entry[:method]} #{entry[:path]} #{entry[:status]}" })
    socket = connect
    socket.write(get("/x"))
    read_response(socket)
    assert_equal ["GET /x 200\n"], log_lines(log, 1)
  end

  def test_an_unknown_format_is_refused
    error = assert_raises(ArgumentError) { NeverBlock::Server.new(ServerHelper::HELLO, workers: 0, access_log: true, access_log_format: :xml) }
    assert_match(/access_log_format must be :common, :json or a callable/, error.message)
  end

  def test_a_target_without_append_is_refused
    error = assert_raises(ArgumentError) { NeverBlock::Server.new(ServerHelper::HELLO, workers: 0, access_log: "log.txt") }
    assert_match(/access_log must be/, error.message)
  end
end
