# frozen_string_literal: true

require_relative "server_helper"

# Rack 2 apps (the gemspec allows rack 2.2) may name their headers in any
# case: "Content-Length", "Transfer-Encoding", "Connection", "Date",
# "Content-Type". The server reads them as it reads Rack 3's lowercase ones,
# so that a response is framed once: read case-sensitively, a Content-Length
# went out beside the server's own (two of them), and a streamed body's
# beside transfer-encoding: chunked, a head that RFC 9112 calls a smuggling
# risk for whatever stands between the server and the client.
class ServerRack2HeadersTest < PlainTest
  include ServerHelper

  EVENTS = Queue.new # the /events body's chunks, nil to end it

  APP = lambda do |env|
    case env["PATH_INFO"]
    when "/events" then [200, { "Content-Type" => "text/event-stream" }, Enumerator.new { |out| while (chunk = EVENTS.pop) do out << chunk end }]
    when "/odd-events" # a name and a media type in cases of their own (both are case-insensitive)
      [200, { "CONTENT-type" => "Text/Event-Stream; charset=utf-8" }, Enumerator.new { |out| while (chunk = EVENTS.pop) do out << chunk end }]
    when "/bad-bytes-events" # a parameter that is not UTF-8
      [200, { "Content-Type" => +"text/event-stream; x=\xff" }, Enumerator.new { |out| while (chunk = EVENTS.pop) do out << chunk end }]
    when "/array" then [200, { "Content-Type" => "text/plain", "Content-Length" => "5" }, ["hello"]]
    when "/stream" then [200, { "Content-Type" => "text/plain", "Content-Length" => "5" }, Enumerator.new { |out| out << "hel" << "lo" }]
    when "/chunked" then [200, { "Transfer-Encoding" => "chunked" }, ["5\r\nhello\r\n0\r\n\r\n"]]
    when "/dated" then [200, { "Date" => "Thu, 01 Jan 2026 00:00:00 GMT", "CONTENT-LENGTH" => "2" }, ["ok"]]
    when "/close" then [200, { "Connection" => "close", "Content-Length" => "2" }, ["ok"]]
    end
  end

  def setup
    start_server(APP, lint: false) # Rack::Lint (Rack 3) refuses uppercase names
  end

  def exchange(path)
    socket = connect
    socket.write(get(path, "Connection: close\r\n"))
    head, body = read_all(socket).split("\r\n\r\n", 2)
    [head.split("\r\n").drop(1).map { |line| line.split(": ", 2).first.downcase }, body]
  end

  def test_an_apps_content_length_in_any_case_is_the_only_one
    names, body = exchange("/array")
    assert_equal 1, names.count("content-length"), names.inspect
    assert_equal "hello", body
  end

  def test_a_streamed_body_with_its_own_content_length_is_not_chunked_as_well
    names, body = exchange("/stream")
    refute_includes names, "transfer-encoding"
    assert_equal 1, names.count("content-length")
    assert_equal "hello", body
  end

  def test_an_apps_own_transfer_encoding_in_any_case_is_not_framed_twice
    names, body = exchange("/chunked")
    assert_equal 1, names.count("transfer-encoding"), names.inspect
    refute_includes names, "content-length"
    assert_equal "5\r\nhello\r\n0\r\n\r\n", body
  end

  def test_an_apps_date_in_any_case_is_the_only_one
    names, = exchange("/dated")
    assert_equal 1, names.count("date"), names.inspect
  end

  def test_an_event_stream_named_in_any_case_gives_its_slot_back
    assert_stream_gives_its_slot_back("/events")
  end

  def test_an_event_stream_whose_media_type_is_in_any_case_gives_its_slot_back
    assert_stream_gives_its_slot_back("/odd-events")
  end

  def test_an_event_stream_whose_content_type_is_not_utf8_is_still_one
    assert_stream_gives_its_slot_back("/bad-bytes-events")
  end

  def assert_stream_gives_its_slot_back(path)
    events = connect
    events.write(get(path))
    EVENTS << "data: one\n\n"
    read_until(events, "data: one", timeout: 10)
    assert_equal({ busy: 0, io_bound: 1 }, @server.stats[:fiber_pool].slice(:busy, :io_bound), "the stream holds no slot")
  ensure
    EVENTS << nil
  end

  def test_connection_close_in_any_case_closes_after_the_response
    socket = connect
    socket.write(get("/close"))
    assert_equal 200, read_response(socket)[0]
    assert_equal "", read_all(socket, timeout: 5), "the connection stayed open"
  end
end
