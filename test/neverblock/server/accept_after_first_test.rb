# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/serve_processes"

# Beside other workers, a worker lets the connection it took in run to its
# first wait before it takes in more of the backlog. (Found with
# bench/faults.rb's crash loop: a worker took in the whole backlog on one
# turn before any of it ran, so one that died on the first request took
# every waiting connection down with it: 16 requests lost per worker
# killed, 11 before 1012449 and with Puma.)
class ServerAcceptAfterFirstTest < PlainTest
  include ServerHelper
  include ServeProcesses

  def teardown
    @sockets&.each { |socket| socket.close unless socket.closed? }
    super
  end

  # Connects to `port` and sends `GET path` once for each path, in order,
  # without waiting for answers (they wait in the kernel's backlog).
  def send_requests(port, paths)
    paths.map { |path| send_without_waiting(port, "GET #{path} HTTP/1.1\r\nHost: localhost\r\n\r\n") }
  end

  # The status of the answer on `socket`, or nil if it was closed unanswered.
  def status(socket)
    read_response(socket, timeout: 30)[0]
  rescue RuntimeError, SystemCallError
    nil
  end

  # Both workers stopped (SIGSTOP) while 16 connections queue in the
  # backlog, the first asking for /die; then one worker goes on alone until
  # it dies. Taking in the whole backlog first, it took all 16 down with
  # it; it takes in the one it dies on, and the other worker answers the 15.
  def test_a_worker_that_dies_on_its_first_request_leaves_the_rest_of_the_backlog_to_the_others
    server = serve("die.ru", "-w", "2")
    workers = worker_pids(server[:pid])
    assert_equal 2, workers.size
    doomed, other = workers
    workers.each { |pid| Process.kill(:STOP, pid) }
    sockets = send_requests(server[:port], ["/die"] + ["/"] * 15)
    Process.kill(:CONT, doomed)
    wait_for_line(server, /\(pid #{doomed}\) died/)
    Process.kill(:CONT, other)
    answered = sockets.drop(1).count { |socket| status(socket) == 200 }
    assert_equal 15, answered, "the worker that died took #{15 - answered} more waiting connections down with it"
  end
end
