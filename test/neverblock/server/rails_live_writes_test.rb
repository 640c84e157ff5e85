# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/live_app"
require_relative "../../support/raw_response"
require "socket"

# A Live action's writes under `neverblock serve` (test/fixtures/server/live_app)
# go straight to the client from the action's fiber (RailsIntegration::LiveWrites):
# no fiber of the server's is woken per event; writers at once (tasks and a
# thread) never cut into each other's events; a client that hangs up ends
# the stream with Rails' ClientDisconnected in the action and a 499.
class ServerRailsLiveWritesTest < PlainTest
  include LiveApp


  def test_events_written_back_to_back_wake_no_other_fiber
    server = serve_live(quiet: true)
    socket = open_stream(server, "/burst?n=200")
    body = chunked_body(read_until(socket, "0\r\n\r\n"))
    events = body.split("\n\n").map { |event| event.delete_prefix("data: ") }
    assert_equal ["start", *Array.new(200, &:to_s)], events[0..-2]
    # Through Rails' queue of ten the server's fiber is woken every few
    # events (about 40 times for 200); written straight through, never.
    switches = Integer(events.last[/\Aswitches (\d+)\z/, 1] || flunk(events.last))
    assert_operator switches, :<, 10, "fibers entered while 200 events were written"
  ensure
    socket&.close
  end

  def test_tasks_and_a_thread_writing_at_once_never_cut_into_each_others_events
    server = serve_live(quiet: true)
    socket = open_stream(server, "/crowd?n=100&fibers=4&bytes=20000")
    body = chunked_body(read_until(socket, "0\r\n\r\n", timeout: 60))
    events = body.split("\n\n")
    assert_equal ["data: start", "data: end"], [events.first, events.last]
    writers = events[1..-2].map do |event|
      writer, index, filler = event.delete_prefix("data: ").split(" ")
      assert_equal "x" * 20_000, filler, "an event cut into: #{event[0, 60].inspect}"
      [writer, Integer(index)]
    end
    by_writer = writers.group_by(&:first).transform_values { |pairs| pairs.map(&:last) }
    assert_equal %w[fiber0 fiber1 fiber2 fiber3 thread], by_writer.keys.sort
    by_writer.each { |writer, indexes| assert_equal (0...100).to_a, indexes, "#{writer}'s events in order" }
  ensure
    socket&.close
  end

  def test_a_client_that_hangs_up_ends_the_stream_with_client_disconnected_and_a_499
    server = serve_live("--access-log")
    socket = open_stream(server, "/until_gone")
    read_until(socket, "data: x")
    socket.close
    ended = wait_for_line(server, /until_gone ended by \S+/, timeout: 30)
    # The hang-up watch (its peek of the socket) may see it first: then the
    # action is cancelled at its sleep.
    assert_match(/until_gone ended by (ActionController::Live::ClientDisconnected|NeverBlock::Cancelled)/, ended)
    assert(eventually { output_lines(server).any? { |line| line.include?('"GET /until_gone HTTP/1.1" 499') } },
           output_lines(server).join)
    noise = output_lines(server).grep(/IOError|FATAL|Completed 500|Error/).reject { |line| line.include?("until_gone ended") }
    assert_empty noise, "logged for a client that hung up:\n#{output_lines(server).join}"
  end

  def test_the_body_ends_after_a_chunk_being_written_when_the_action_closed_the_stream
    server = serve_live(quiet: true)
    socket = open_stream(server, "/close_mid_write")
    sleep 1.5 # the action closes the stream while its task's big chunk waits for this client
    response = read_until(socket, "0\r\n\r\n", timeout: 60)
    assert_equal "start\n#{'A' * 32_000_000}\n", chunked_body(response), "the chunk whole, then the body's end"
    assert response.end_with?("\r\n0\r\n\r\n"), "nothing after the end: #{response[-40..].inspect}"
    socket.write("GET /plain HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert_match(/\AHTTP\/1\.1 200 OK\r\n.*\r\n\r\nok\n\z/m, read_until(socket, "ok\n"), "the connection's next request")
  ensure
    socket&.close
  end

  def test_a_writer_cancelled_mid_chunk_cuts_the_response_and_closes_the_connection
    server = serve_live
    socket = open_stream(server, "/cancel_writer")
    sleep 1.5
    received = read_all(socket, timeout: 30)
    refute_includes received, "0\r\n\r\n", "a cut response must not look whole"
    # The action's next write finds the stream aborted, or the request's end
    # (the server's writing failed) cancels the action first.
    ended = wait_for_line(server, /cancel_writer ended by \S+/, timeout: 30)
    assert_match(/ActionController::Live::ClientDisconnected|NeverBlock::Cancelled/, ended)
    assert(eventually { output_lines(server).any? { |line| line.include?("WriteInterrupted") } }, output_lines(server).join)
    refute(output_lines(server).any? { |line| line.include?("unhandled") }, output_lines(server).join)
  ensure
    socket&.close
  end

  def test_a_queued_chunk_goes_before_a_later_direct_write
    server = serve_live(quiet: true)
    socket = open_stream(server, "/ordered")
    sleep 1 # the thread's X is queued while the task's Z waits for this client
    lines = chunked_body(read_until(socket, "0\r\n\r\n", timeout: 60)).lines.map { |line| line[0] }
    assert_equal %w[s Z X W], lines
  ensure
    socket&.close
  end

  def test_a_middleware_that_refuses_a_chunk_ends_the_stream_and_is_logged_once
    server = serve_live
    socket = open_stream(server, "/refused_chunk")
    received = read_all(socket, timeout: 30)
    assert_includes received, "fine\n"
    refute_includes received, "bad\n"
    ended = wait_for_line(server, /refused_chunk ended by \S+/, timeout: 30)
    assert_includes ended, "ActionController::Live::ClientDisconnected", "Rails' error for a stream that cannot go on"
    assert(eventually { output_lines(server).any? { |line| line.include?("refused chunk") } })
    lines = output_lines(server)
    assert_equal 1, lines.count { |line| line.include?("ArgumentError: refused chunk") }, lines.join
    refute(lines.any? { |line| line.include?("FATAL") || line.include?("Completed 500") }, lines.join)
  ensure
    socket&.close
  end

  def test_another_requests_write_to_a_stream_is_queued_not_made_to_wait_for_its_client
    server = serve_live(quiet: true)
    subscriber = open_stream(server, "/subscribe") # reads the first line, then nothing
    read_until(subscriber, "subscribed")
    seconds = Float(get(server, "/broadcast").body)
    # Written straight through it would wait for the subscriber to read 32 MB.
    assert_operator seconds, :<, 2, "the broadcast's write to a client that does not read"
    assert_equal "released", get(server, "/release?n=1").body
    assert_includes read_until(subscriber, "0\r\n\r\n", timeout: 60), "B" * 1000
  ensure
    subscriber&.close
  end

  private

  # The body of a chunked response (headers dropped, chunks joined).
  def chunked_body(response)
    RawResponse.dechunk(response.split("\r\n\r\n", 2).last)
  end
end
