# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/live_app"
require "json"
require "socket"

# ActionController::Live under `neverblock serve` (test/fixtures/server/live_app):
# each action runs as a task of its request on the loop, with Rails'
# semantics for its headers, errors and locals; a committed stream holds no
# request slot; a client that hangs up ends its stream quietly. Requests
# that come without NeverBlock's env key (as under another server) get
# Rails' own thread.
class ServerRailsLiveTest < PlainTest
  include LiveApp

  STREAMS = 200

  def test_a_live_action_runs_on_the_loop_as_a_child_of_its_request_and_sees_its_locals
    server = serve_live
    event = first_event(server, "/events?one")
    assert_equal({ "same_thread" => true, "child_of_request" => true, "local" => "local one", "current" => "tag one",
                   "assigns" => [] }, event, "assigns: what of NeverBlock's a view would get")
  end

  def test_two_hundred_streams_start_no_thread_and_complete
    server = serve_live(quiet: true)
    threads_before = Integer(get(server, "/threads").body)
    streams = Array.new(STREAMS) { open_stream(server, "/events?hold") }
    streams.each { |socket| assert_includes read_until(socket, "\n\n"), "data: {" }
    threads_during = Integer(get(server, "/threads").body)
    # Rails' own Live starts a thread per stream (STREAMS more).
    assert_operator threads_during - threads_before, :<, 10,
                    "threads: #{threads_before} before the streams, #{threads_during} with #{STREAMS} open"

    assert_equal "released", get(server, "/release?n=#{STREAMS}").body
    streams.each { |socket| assert_includes read_until(socket, "0\r\n\r\n"), "data: done" }
  ensure
    streams&.each(&:close)
  end

  def test_committed_streams_give_their_request_slots_back
    server = serve_live("--fiber-pool", "4", "--no-adaptive-limit", "--status", "/_status", quiet: true)
    streams = Array.new(12) { open_stream(server, "/events?hold") }
    streams.each { |socket| read_until(socket, "\n\n") }
    # With the streams holding their slots the status request would wait
    # for one: it is answered, and it is the only request holding a slot.
    pool = JSON.parse(get(server, "/_status").body).fetch("fiber_pool")
    assert_equal [1, 12], pool.values_at("busy", "io_bound"), pool.inspect
    get(server, "/release?n=12")
    streams.each { |socket| assert_includes read_until(socket, "0\r\n\r\n"), "data: done" }
  ensure
    streams&.each(&:close)
  end

  def test_an_exception_before_the_first_write_gets_rails_error_response
    server = serve_live
    assert_equal "500", get(server, "/boom_before").code
    response = get(server, "/refused")
    assert_equal ["422", "rescued\n"], [response.code, response.body], "rescue_from answers"
    assert(eventually { output_lines(server).any? { |line| line.include?("boom before commit") } })
  end

  def test_an_exception_after_the_first_write_is_logged_and_closes_the_stream
    server = serve_live
    socket = open_stream(server, "/boom_after")
    body = read_until(socket, "0\r\n\r\n")
    assert_match(/\AHTTP\/1\.1 200 /, body)
    assert_includes body, "data: one"
    assert(eventually { output_lines(server).any? { |line| line.include?("RuntimeError (boom after commit)") } })
  ensure
    socket&.close
  end

  def test_a_client_that_hangs_up_ends_its_stream_without_an_error_logged
    server = serve_live
    socket = open_stream(server, "/heartbeat")
    read_until(socket, "data: beat")
    socket.close
    completed = wait_for_line(server, /Completed \d+ .* in \d+ms/, timeout: 30)
    lines = output_lines(server)
    # The action's next write finds the client gone (Rails' ClientDisconnected),
    # or the hang-up watch sees it first and cancels the action at its sleep.
    assert_match(/heartbeat ended by (ActionController::Live::ClientDisconnected|NeverBlock::Cancelled)/, lines.join)
    assert_match(/Completed 200 OK/, completed)
    noise = lines.grep(/ClientDisconnected|IOError|FATAL|Completed 500|Error/).reject { |line| line.include?("heartbeat ended") }
    assert_empty noise, "logged for a client that hung up:\n#{lines.join}"
  end

  def test_a_request_without_neverblocks_env_gets_rails_own_thread
    server = serve_live
    event = first_event(server, "/stock/events?stock")
    assert_equal [false, "local stock"], event.values_at("same_thread", "local"), event.inspect
  end

  private

  # The JSON of the first server-sent event of `path`.
  def first_event(server, path)
    socket = open_stream(server, path)
    JSON.parse(read_until(socket, "\n\n")[/^data: (.*)$/, 1])
  ensure
    socket&.close
  end
end
