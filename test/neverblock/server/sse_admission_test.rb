# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/server_process"
require "socket"

# 1,000 open server-sent event streams, each marked IO-bound, hold no request
# slot: fast requests served meanwhile are about as quick as with no stream
# open. (Without the mark the streams take the adaptive limit's slots, and the
# fast requests wait behind them for as long as the streams last.)
class SSEAdmissionTest < PlainTest
  include ServerProcess

  EXE = File.expand_path("../../../exe/neverblock", __dir__)
  FIXTURE = File.expand_path("../../fixtures/server/sse.ru", __dir__)
  STREAMS = 1000
  FAST = 300

  def test_fast_requests_beside_a_thousand_open_streams_stay_within_twice_their_p99_alone
    port = free_port
    start(RbConfig.ruby, EXE, "serve", FIXTURE, "-p", port.to_s, "-w", "0")
    wait_for_answer(port)
    alone = p99(fast_requests(port))

    streams = open_streams(port)
    deadline = now + 30
    streams.each { |socket| socket.wait_readable([deadline - now, 0].max) or flunk "a stream sent no first event in 30 s" }
    with_streams = p99(fast_requests(port))
    # Orders of magnitude: waiting behind the streams is seconds (as long as
    # they last); beside three test suites the p99 reached 0.1 s unharmed.
    assert_operator with_streams, :<=, [2 * alone, 0.25].max,
                    "fast requests' p99 beside #{STREAMS} streams (#{(with_streams * 1000).round(2)} ms) " \
                    "against alone (#{(alone * 1000).round(2)} ms)"
    assert(streams.all? { |socket| socket.readpartial(65_536).include?("data: tick") }, "the streams still stream")
  ensure
    streams&.each(&:close)
  end

  private

  def open_streams(port)
    Array.new(STREAMS) do
      socket = TCPSocket.new("127.0.0.1", port)
      socket.write("GET /events HTTP/1.1\r\nHost: localhost\r\n\r\n")
      socket
    end
  end

  # FAST keep-alive GETs, one after the other; each one's seconds.
  def fast_requests(port)
    socket = TCPSocket.new("127.0.0.1", port)
    Array.new(FAST) do
      started = now
      socket.write("GET / HTTP/1.1\r\nHost: localhost\r\n\r\n")
      response = +""
      until response.end_with?("\r\n\r\nok")
        socket.wait_readable(10) or flunk "a fast request had no answer in 10 s"
        response << socket.readpartial(4096)
      end
      now - started
    end
  ensure
    socket&.close
  end

  def p99(durations)
    durations.sort[(durations.size * 0.99).ceil - 1]
  end
end
