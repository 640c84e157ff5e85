# frozen_string_literal: true

require_relative "server_helper"

# A request body arrives holding no request slot, and within limits:
# `body_timeout` (no progress), `min_body_rate` (bytes per second over each
# body_timeout window) and `request_timeout` (from the end of the head).
# A client that trickles its body (slowloris on the body) neither takes a
# slot from complete requests nor holds its connection for long.
class ServerSlowBodyTest < PlainTest
  include ServerHelper

  def setup
    @calls = Queue.new
    calls = @calls
    @app = lambda do |env|
      body = env["rack.input"].read
      calls << [env["PATH_INFO"], body.bytesize]
      [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]]
    end
  end

  def teardown
    @tricklers&.each(&:kill)
    @sockets&.each(&:close) # a body still arriving would hold the stop until it is refused
    super
  end

  # Opens a connection that sends a POST head promising `length` bytes, then
  # one byte every `interval` seconds, until killed or the server closes it.
  def trickle(length:, interval:)
    socket = connect
    socket.write("POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: #{length}\r\n\r\nx")
    (@tricklers ||= []) << Thread.new do
      loop do
        sleep interval
        socket.write("x")
      end
    rescue IOError, SystemCallError
      nil # the server refused it and closed
    end
    socket
  end

  # Reads one response's status, or nil when none comes within `timeout`.
  def status_within(socket, timeout)
    return nil unless socket.wait_readable(timeout)

    socket.gets("\r\n")&.[](/\AHTTP\/1\.1 (\d{3})/, 1)&.to_i
  end

  def busy_slots
    @server.stats[:fiber_pool][:busy]
  end

  # Were the trickled bodies to hold the two slots, the complete request
  # would wait until min_body_rate refused them, after a body_timeout
  # window of 60 s: an order of magnitude past the 20 s a loaded machine
  # may take to answer it.
  def test_bodies_still_arriving_hold_no_request_slot
    start_server(@app, fiber_pool: 2, body_timeout: 60)
    sockets = 5.times.map { trickle(length: 1000, interval: 0.5) }
    sleep 0.5 # their heads are read (were they not, the test would only be weaker)
    started = NeverBlock::Clock.now
    client = connect
    client.write(get("/fast"))
    status, = read_response(client, timeout: 30)
    assert_equal 200, status
    assert_operator NeverBlock::Clock.now - started, :<, 20, "a complete request waited behind bodies still arriving"
    assert_equal 0, busy_slots, "a body still arriving took a request slot"
    assert_equal 5, sockets.count { |socket| !socket.wait_readable(0) }, "a trickled upload was answered early"
    assert_equal [["/fast", 0]], [@calls.pop]
  end

  def test_request_timeout_bounds_the_body_from_the_end_of_the_head
    start_server(@app, request_timeout: 1, body_timeout: 60)
    socket = trickle(length: 1000, interval: 0.1) # 10 B/s: min_body_rate would take its window, 60 s
    started = NeverBlock::Clock.now
    assert_equal 408, status_within(socket, 30)
    elapsed = NeverBlock::Clock.now - started
    assert_operator elapsed, :>=, 0.9
    assert_operator elapsed, :<, 20, "request_timeout 1 s did not bound the body's arrival"
    assert_empty @calls
  end

  def test_a_body_slower_than_min_body_rate_is_408_within_a_window
    # 10 bytes a second against a minimum of 100: every read makes progress,
    # so body_timeout alone never fires (a byte every 0.1 s against 5 s:
    # a loaded machine's pause of the trickling thread does not reach it).
    start_server(@app, body_timeout: 5, min_body_rate: 100)
    log = capture_log do
      socket = trickle(length: 1000, interval: 0.1)
      started = NeverBlock::Clock.now
      assert_equal 408, status_within(socket, 30)
      assert_operator NeverBlock::Clock.now - started, :<, 20 # one 5 s window; without min_body_rate, never
    end
    assert_match(/408: request body slower than min_body_rate 100 bytes\/s/, log)
    assert_empty @calls
  end

  def test_min_body_rate_zero_leaves_only_body_timeout
    # 1 + 49 bytes over 4.9 s: past the first 4 s window (with a minimum
    # rate, refused there), never 4 s without one (a byte every 0.1 s: a
    # loaded machine's pause of the trickling thread does not reach that).
    start_server(@app, body_timeout: 4, min_body_rate: 0, request_timeout: nil)
    socket = trickle(length: 50, interval: 0.1)
    assert_equal 200, status_within(socket, 30)
    assert_equal [["/upload", 50]], [@calls.pop]
  end

  def test_a_slow_steady_upload_above_the_minimum_succeeds
    # 5,000 bytes a second for 6 s (into a Tempfile: over max_body_in_memory)
    # against a minimum of 1,000 over 4 s windows: past the first window,
    # and a window's 4,000 bytes are in after 0.8 s of sending, so a loaded
    # machine's pause of up to 3 s in one does not make the upload too slow.
    start_server(@app, body_timeout: 4, min_body_rate: 1000, max_body_in_memory: 4096)
    socket = connect
    length = 30_000
    socket.write("POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: #{length}\r\n\r\n")
    60.times do
      sleep 0.1
      socket.write("y" * 500)
    end
    status, _, body = read_response(socket, timeout: 30)
    assert_equal 200, status
    assert_equal length, body.bytesize
    assert_equal [["/upload", length]], [@calls.pop]
  end

  # Were the POST's body to hold the slot, the other request would wait
  # until body_timeout (60 s) refused it: an order of magnitude past the
  # 20 s a loaded machine may take to answer it.
  def test_a_pipelined_request_behind_a_trickled_body_takes_no_slot_meanwhile
    start_server(@app, fiber_pool: 1, body_timeout: 60)
    socket = connect
    # A complete GET, then a POST whose body trickles: the GET is answered
    # and its slot given back while the POST's body is still arriving.
    socket.write("#{get('/first')}POST /upload HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\nx")
    status, = read_response(socket)
    assert_equal 200, status
    other = connect
    other.write(get("/other"))
    status, = read_response(other, timeout: 20)
    assert_equal 200, status
    assert_equal 0, busy_slots
  end

  def test_min_body_rate_must_be_a_non_negative_integer
    error = assert_raises(ArgumentError) { NeverBlock::Server::Limits.build(min_body_rate: -1) }
    assert_match(/min_body_rate must be an Integer >= 0/, error.message)
    assert_equal 0, NeverBlock::Server::Limits.build(min_body_rate: 0).min_body_rate
  end
end
