# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/live_app"
require "socket"

# ActionController::Live streams under the server's limits, stops and
# restarts (test/fixtures/server/live_app): `request_timeout` cuts a stream
# at its deadline; a stop (TERM) lets a stream with an end finish, and cuts
# an endless one after `shutdown_timeout`, and the process then exits; a
# rolling restart (USR2) lets the old worker's stream finish.
class ServerRailsLiveLimitsTest < PlainTest
  include LiveApp

  def test_request_timeout_cuts_an_endless_live_stream
    server = serve_live("--request-timeout", "1")
    socket = open_stream(server, "/heartbeat")
    took = elapsed { @body = read_all(socket, timeout: 20, within: 20) }
    assert_match(/\AHTTP\/1\.1 200 /, @body)
    assert_includes @body, "data: beat"
    refute @body.end_with?("0\r\n\r\n"), "a stream cut at its deadline ends without the last chunk:\n#{@body[-200..]}"
    assert_operator took, :<, 10, "the heartbeat never ends by itself: request_timeout (1 s) cut it"
    assert(eventually { output_lines(server).any? { |line| line.include?("heartbeat ended by") } })
  ensure
    socket&.close
  end

  def test_a_stop_lets_a_live_stream_with_an_end_finish
    server = serve_live("--shutdown-timeout", "30")
    socket = open_stream(server, "/ticks?n=30")
    assert_includes read_until(socket, "data: tick 0", timeout: 15), "200"
    Process.kill("TERM", server[:pid])
    body = read_all(socket, timeout: 30, within: 30)
    assert_includes body, "data: tick 29"
    assert_includes body, "data: done"
    assert body.end_with?("0\r\n\r\n"), "the stream ended whole:\n#{body[-200..]}"
    assert wait_exit(server, timeout: 30).success?
  ensure
    socket&.close
  end

  def test_a_stop_cuts_an_endless_live_stream_after_shutdown_timeout
    server = serve_live("--shutdown-timeout", "1")
    socket = open_stream(server, "/heartbeat")
    read_until(socket, "data: beat", timeout: 15)
    Process.kill("TERM", server[:pid])
    took = elapsed { @body = read_all(socket, timeout: 20, within: 20) }
    assert_operator took, :<, 15, "the heartbeat never ends by itself: the stop cut it after shutdown_timeout (1 s)"
    assert_includes @body, "data: beat", "beats went on during shutdown_timeout"
    assert wait_exit(server, timeout: 30).success?
  ensure
    socket&.close
  end

  def test_a_rolling_restart_lets_a_live_stream_finish
    server = serve_live("-w", "2")
    socket = open_stream(server, "/ticks?n=160") # 8 s: both old workers are told to stop meanwhile
    assert_includes read_until(socket, "data: tick 0", timeout: 15), "200"
    Process.kill("USR2", server[:pid])
    body = read_all(socket, timeout: 60, within: 60)
    assert_includes body, "data: tick 159"
    assert body.end_with?("data: done\n\n\r\n0\r\n\r\n"), "the stream ended whole:\n#{body[-200..]}"
    wait_for_line(server, /rolling restart done/, timeout: 120)
    assert_equal "200", get(server, "/plain").code
  ensure
    socket&.close
  end
end
