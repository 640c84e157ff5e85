# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/socket_queues"

# Empty lines (CRLF) before a request line: up to four are skipped
# (RFC 9112 2.2), more are refused with 400, and they begin no request:
# a connection that receives only them is as idle as one that receives
# nothing, and is closed at its idle timeout.
class ServerEmptyLinesTest < PlainTest
  include ServerHelper

  def test_a_request_after_four_empty_lines_is_served
    start_server
    socket = connect
    socket.write("\r\n" * 4 + get("/after"))
    status, _headers, body = read_response(socket)
    assert_equal [200, "hello\n"], [status, body]
  end

  # Each line read on its own, as a client that trickles them sends them.
  def test_the_fifth_empty_line_before_a_request_is_refused
    start_server
    socket = connect
    capture_log do
      4.times do
        socket.write("\r\n")
        SocketQueues.wait_until_read(@port, [socket])
      end
      refute socket.wait_readable(0), "no answer to four empty lines"
      socket.write("\r\n")
      status, headers, = read_response(socket)
      assert_equal [400, "close"], [status, headers["connection"]]
    end
  end

  # A client that sends `\r\n` now and then, and never a request, was
  # never answered nor closed: each line started a new idle wait.
  def test_empty_lines_do_not_extend_the_idle_timeout
    start_server(idle_timeout: 1)
    socket = connect
    socket.write(get("/first"))
    assert_equal 200, read_response(socket).first
    sent = 0
    # Every 0.9 s (the client's pace, not a timing asserted): the server
    # closes within 1.125 s of the response; a new wait per line would
    # last until 1 s after the last one.
    until socket.wait_readable(0.9) || sent == 4
      socket.write("\r\n")
      sent += 1
    end
    assert_equal "", read_all(socket), "closed as idle, with no answer"
    assert_operator sent, :<, 4, "closed at its idle timeout, not #{sent} lines later"
  end
end

# The same, each idle connection waiting in a fiber of its own (no IdleSet).
class ServerEmptyLinesFiberPerIdleConnectionTest < ServerEmptyLinesTest
  include FiberPerIdleConnection
end
