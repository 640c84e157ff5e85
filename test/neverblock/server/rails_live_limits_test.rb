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
    took = elapsed { @body = read_to_end(socket, 20) }
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
    assert_includes read_until(socket, "data: tick 0"), "200"
    Process.kill("TERM", server[:pid])
    body = read_to_end(socket, 30)
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
    read_until(socket, "data: beat")
    Process.kill("TERM", server[:pid])
    took = elapsed { @body = read_to_end(socket, 20) }
    assert_operator took, :<, 15, "the heartbeat never ends by itself: the stop cut it after shutdown_timeout (1 s)"
    assert_includes @body, "data: beat", "beats went on during shutdown_timeout"
    assert wait_exit(server, timeout: 30).success?
  ensure
    socket&.close
  end

  def test_a_rolling_restart_lets_a_live_stream_finish
    server = serve_live("-w", "2")
    socket = open_stream(server, "/ticks?n=160") # 8 s: both old workers are told to stop meanwhile
    assert_includes read_until(socket, "data: tick 0"), "200"
    Process.kill("USR2", server[:pid])
    body = read_to_end(socket, 60)
    assert_includes body, "data: tick 159"
    assert body.end_with?("data: done\n\n\r\n0\r\n\r\n"), "the stream ended whole:\n#{body[-200..]}"
    wait_for_line(server, /rolling restart done/, timeout: 120)
    assert_equal "200", get(server, "/plain").code
  ensure
    socket&.close
  end

  private

  def read_until(socket, marker, timeout: 15)
    data = +""
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
    until data.include?(marker)
      remaining = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
      flunk "no #{marker.inspect} within #{timeout} s; got:\n#{data}" unless remaining.positive? && socket.wait_readable(remaining)
      chunk = socket.read_nonblock(65_536, exception: false)
      flunk "EOF before #{marker.inspect}; got:\n#{data}" if chunk.nil?
      data << chunk if chunk.is_a?(String)
    end
    data
  end

  # Everything up to EOF (or a reset), within `timeout` seconds.
  def read_to_end(socket, timeout)
    data = +""
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
    loop do
      remaining = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
      flunk "the stream did not end within #{timeout} s; got #{data.bytesize} bytes" unless remaining.positive?
      next unless socket.wait_readable(remaining)

      chunk = socket.read_nonblock(65_536, exception: false)
      break if chunk.nil?

      data << chunk if chunk.is_a?(String)
    rescue Errno::ECONNRESET
      break
    end
    data
  end
end
