# frozen_string_literal: true

require_relative "server_helper"

# env["neverblock.mark_as_io_bound"]: a request that from some point on only
# waits gives its request slot back, so it does not hold back new arrivals;
# the request itself is still answered, and a pipelined request after it
# takes a slot again.
class ServerIOBoundTest < PlainTest
  include ServerHelper

  # GET /wait marks itself IO-bound (recording what the call returned, twice)
  # and waits until the test releases it; anything else answers at once.
  def app(release, marks)
    lambda do |env|
      if env["PATH_INFO"] == "/wait"
        marks << env[NeverBlock::Server::MARK_AS_IO_BOUND].call
        marks << NeverBlock::Server.mark_as_io_bound(env)
        release.pop
      end
      [200, { "content-length" => "2" }, ["ok"]]
    end
  end

  def test_a_request_marked_io_bound_gives_its_slot_back_and_is_still_answered
    release = Queue.new
    marks = Queue.new
    start_server(app(release, marks), fiber_pool: 1, adaptive_limit: false)
    waiting = connect
    waiting.write(get("/wait"))
    assert_equal [true, false], [marks.pop, marks.pop], "the first call gives the slot back, the second has none to give"

    fast = connect
    fast.write(get)
    assert_equal [200, "ok"], read_response(fast, timeout: 5).values_at(0, 2),
                 "answered while the only request slot's first holder still waits"
    assert_equal({ size: 1, limit: 1, busy: 0, queued: 0, io_bound: 1 }, @server.stats[:fiber_pool])

    release << true
    assert_equal [200, "ok"], read_response(waiting).values_at(0, 2)
    eventually { @server.stats[:requests_in_flight].zero? }
    assert_equal 0, @server.stats[:fiber_pool][:busy], "the slot was given back once, not twice"
  end

  def test_a_pipelined_request_after_an_io_bound_one_takes_a_slot_again
    release = Queue.new
    marks = Queue.new
    hold = Queue.new
    inner = app(release, marks)
    start_server(->(env) { env["PATH_INFO"] == "/hold" ? (hold.pop && inner.call(env)) : inner.call(env) },
                 fiber_pool: 1, adaptive_limit: false)
    pipelined = connect
    pipelined.write(get("/wait") + get("/hold"))
    marks.pop
    release << true
    assert_equal 200, read_response(pipelined)[0]
    eventually { @server.stats[:fiber_pool][:busy] == 1 } # /hold has the only slot

    other = connect
    other.write(get)
    refute other.wait_readable(0.3), "answered while /hold held the only slot (the server does not even accept then)"
    hold << true
    assert_equal 200, read_response(pipelined)[0]
    assert_equal 200, read_response(other)[0]
  end

  # A streamed text/event-stream response only waits for its next event
  # from the start of its body on, as a Live stream does: it gives its slot
  # back then, unmarked. Any other streamed body keeps its slot while it is
  # written (it may compute each chunk).
  def test_an_event_stream_gives_its_slot_back_when_its_body_starts_and_other_streams_keep_theirs
    chunks = { "/plain" => Queue.new, "/events" => Queue.new } # each body's own
    start_server(lambda do |env|
      type = env["PATH_INFO"] == "/events" ? "text/event-stream; charset=utf-8" : "text/plain"
      queue = chunks.fetch(env["PATH_INFO"])
      body = Enumerator.new { |out| while (chunk = queue.pop) do out << chunk end }
      [200, { "content-type" => type }, body]
    end, fiber_pool: 2, adaptive_limit: false)

    plain = connect
    plain.write(get("/plain"))
    chunks["/plain"] << "one\n"
    read_until(plain, "one\n", timeout: 10)
    assert_equal({ busy: 1, io_bound: 0 }, @server.stats[:fiber_pool].slice(:busy, :io_bound))

    events = connect
    events.write(get("/events"))
    chunks["/events"] << "data: one\n\n"
    read_until(events, "data: one", timeout: 10)
    assert_equal({ busy: 1, io_bound: 1 }, @server.stats[:fiber_pool].slice(:busy, :io_bound),
                 "the event stream holds no slot; the plain stream still holds its own")

    chunks.each_value { |queue| queue << nil }
    [plain, events].each { |socket| read_until(socket, "0\r\n\r\n", timeout: 10) }
    eventually { @server.stats[:requests_in_flight].zero? }
    assert_equal 0, @server.stats[:fiber_pool][:busy], "each slot was given back once"
  end

  def test_outside_neverblock_server_marking_does_nothing
    refute NeverBlock::Server.mark_as_io_bound({})
  end
end
