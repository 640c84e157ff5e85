# frozen_string_literal: true

require_relative "../../test_helper"
require "net/http"
require "socket"
require_relative "../../support/serve_processes"

# A graceful stop (TERM) as a load balancer sees it: while the requests in
# flight finish, a new connection is refused at once (never queued in the
# kernel to be reset when the drain ends), and one that was already queued
# gets an answer.
class ServerStopListenersTest < PlainTest
  include ServeProcesses

  REQUEST = "GET / HTTP/1.1\r\nhost: test\r\n\r\n"

  # The request in flight lasts 8 s, so that refusing only once it ended is
  # far from refusing at once (milliseconds), past any pause of a loaded
  # machine.
  def test_term_refuses_new_connections_at_once_while_requests_in_flight_finish
    server = serve("pids.ru", "-w", "2", "--shutdown-timeout", "30")
    eventually { worker_pids(server[:pid]).size == 2 }
    # Connected before TERM (so in the kernel's queue at least; a thread's
    # Net::HTTP on a loaded machine could connect only after the listeners
    # closed), and in a worker's app before TERM.
    slow = TCPSocket.new("127.0.0.1", server[:port])
    slow.write("GET /slow?8 HTTP/1.1\r\nhost: test\r\n\r\n")
    wait_for_line(server, /slow request in/)
    Process.kill("TERM", server[:pid])
    termed = now
    outcomes = []
    refused_after = nil
    until refused_after || now - termed > 6
      begin
        socket = TCPSocket.new("127.0.0.1", server[:port])
        socket.write(REQUEST)
        outcomes << answer(socket)
      rescue Errno::ECONNREFUSED
        refused_after = now - termed
      ensure
        socket&.close
      end
      sleep 0.05
    end
    refute_nil refused_after, "still taking connections 6 s after TERM (#{outcomes.inspect}), while a request drains"
    assert_operator refused_after, :<, 5, "refused only #{refused_after.round(2)} s after TERM"
    outcomes.each { |outcome| assert_match(%r{\AHTTP/1\.1 (200|503)}, outcome, "a connection taken during the stop") }
    assert_match(%r{\AHTTP/1\.1 200 }, answer(slow, 30), "the request in flight finished")
    assert wait_exit(server).success?
  ensure
    slow&.close
  end

  def test_connections_queued_when_term_arrives_are_answered_not_reset
    # The slow request holds the one connection until past TERM, with room
    # for a loaded machine's pauses: were it over first, the worker would
    # take the queued ones in and serve them.
    server = serve("pids.ru", "-w", "1", "--max-connections", "1", "--shutdown-timeout", "30")
    slow = Thread.new { get(server, "/slow?6") }
    wait_for_line(server, /slow request in/) # the worker's one connection is taken: the next ones wait in the kernel's queue
    queued = Array.new(3) do
      TCPSocket.new("127.0.0.1", server[:port]).tap { |socket| socket.write(REQUEST) }
    end
    Process.kill("TERM", server[:pid])
    answers = queued.map { |socket| answer(socket, 30) }
    answers.each { |outcome| assert_match(%r{\AHTTP/1\.1 503 .*retry-after: 1}m, outcome) }
    assert_equal "200", slow.value.code
    assert wait_exit(server).success?
  ensure
    queued&.each(&:close)
  end

  # With room for them, the queued connections are served, not refused:
  # they queue while the worker is stopped (SIGSTOP) and so takes none, TERM
  # arrives meanwhile, and once the worker goes on, its stop takes them in.
  def test_connections_queued_at_term_with_room_are_served
    server = serve("pids.ru", "-w", "1", "--shutdown-timeout", "10")
    worker = eventually { (w = worker_pids(server[:pid])).size == 1 && w.first }
    Process.kill("STOP", worker)
    queued = Array.new(3) do
      TCPSocket.new("127.0.0.1", server[:port]).tap { |socket| socket.write(REQUEST) }
    end
    Process.kill("TERM", server[:pid])
    sleep 0.3 # the master has closed its listener and signalled the worker
    Process.kill("CONT", worker)
    answers = queued.map { |socket| answer(socket, 30) }
    # 200, usually with `connection: close`; without it when the worker,
    # let go, served a queued request before it handled the TERM that
    # waited while it was stopped (the idle connection then closes, as a
    # keep-alive client expects of any server).
    answers.each { |outcome| assert_match(%r{\AHTTP/1\.1 200 }, outcome, output_lines(server).join) }
    assert wait_exit(server).success?
  ensure
    queued&.each(&:close)
  end

  private

  # What the server answered on `socket` (a request was sent), or how the
  # connection ended instead: "EOF", "reset" or "timeout".
  def answer(socket, seconds = 5)
    return "timeout" unless socket.wait_readable(seconds)

    data = socket.read_nonblock(4096, exception: false)
    data.is_a?(String) ? data : "EOF"
  rescue Errno::ECONNRESET
    "reset"
  end
end
