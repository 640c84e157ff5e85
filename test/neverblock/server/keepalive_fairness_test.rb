# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/serve_processes"
require "tmpdir"

# Keep-alive clients of requests that compute (and never yield) share the
# server fairly: within a worker, a client whose next request is already
# there when its response is written does not have it served ahead of the
# others again and again (Connection::TURN); across workers, connections
# accepted unevenly are moved to the worker serving fewer (Handoff), so
# that no client waits several times its share while a core has less to do.
# Judged by counts (answers per client, connections per worker), not by
# seconds, so that a loaded machine does not decide it.
class ServerKeepAliveFairnessTest < PlainTest
  include ServerHelper
  include ServeProcesses

  REQUEST = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"

  # Keep-alive clients opened together (so they wait in the backlog
  # together), each sending its next request as soon as it has an answer.
  class Clients
    # @return [Array<Integer>] answers per client.
    attr_reader :answers

    # @return [Array<String>] per client, the pid that served its last answer.
    attr_reader :last_pids

    def initialize(test, port, count)
      @running = true
      @answers = Array.new(count, 0)
      @last_pids = Array.new(count)
      @sockets = Array.new(count) { test.send_without_waiting(port, REQUEST) }
      @threads = @sockets.each_with_index.map do |socket, index|
        Thread.new do
          first = true
          while @running
            socket.write(REQUEST) unless first
            first = false
            status, headers, = test.read_response(socket, timeout: 60)
            raise "status #{status}" unless status == 200

            @last_pids[index] = headers["x-pid"]
            @answers[index] += 1
          end
        rescue IOError, SystemCallError
          nil # #stop closed its socket
        end
      end
    end

    # Waits until every client has at least `count` answers.
    def wait_for(count, timeout: 60)
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
      sleep 0.05 until @answers.min >= count || Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
      @answers.min
    end

    # Answers per client while they had `total` more between them.
    def during(total, timeout: 120)
      before = @answers.dup
      deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
      sleep 0.05 until @answers.sum - before.sum >= total || Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
      @answers.zip(before).map { |after, was| after - was }
    end

    def stop
      @running = false
      @sockets.each { |socket| socket.close unless socket.closed? }
      @threads.each { |thread| thread.join(10) }
    end
  end

  def teardown
    @clients&.stop
    super
  end

  # One worker, 8 clients of 5 ms requests: in a window where they had 160
  # answers between them (20 turns), each had a share. Served inline, a
  # client that answers fast had many turns in a row while others waited:
  # the fewest answers were a fifth of the most, or none.
  def test_keep_alive_clients_of_one_worker_each_get_a_share
    server = serve("busy.ru", "-w", "0", env: { "BUSY_MS" => "5" })
    @clients = Clients.new(self, server[:port], 8)
    @clients.wait_for(2)
    counts = @clients.during(160)
    assert_fair_shares(counts)
  end

  # Two workers, 10 clients that connect together: whichever worker takes
  # them in from the backlog, they end up 5 and 5 (or 6 and 4 while one is
  # on its way), and over the next 200 answers each client gets a share.
  def test_keep_alive_clients_are_spread_over_two_workers
    assert_spread(workers: 2, clients: 10, most: 6)
  end

  # The same over four workers: 10 clients, at most 4 on one worker.
  def test_keep_alive_clients_are_spread_over_four_workers
    assert_spread(workers: 4, clients: 10, most: 4)
  end

  # Every client connects while the second worker still boots, so the
  # first takes them all in: once the second serves, half of them move to
  # it (the Handoff), each with its request, and none is lost.
  def test_connections_taken_in_by_one_worker_move_to_a_sibling_that_comes_up_later
    config = File.join(Dir.mktmpdir("nb-handoff"), "late.rb")
    File.write(config, "workers 2\non_worker_boot { |index| sleep 4 if index == 1 }\n")
    server = spawn_serve("busy.ru", "-C", config, env: { "BUSY_MS" => "5" })
    port = Integer(wait_for_line(server, %r{listening on tcp://127\.0\.0\.1:(\d+)})[/:(\d+)\s*\(/, 1])
    @clients = Clients.new(self, port, 10)
    @clients.wait_for(3)
    assert_equal 1, @clients.last_pids.uniq.size, "the second worker was up already: #{@clients.last_pids.tally}"
    wait_for_line(server, /serving/)
    @clients.during(300)
    per_worker = @clients.last_pids.tally
    assert_equal 2, per_worker.size, "connections per worker: #{per_worker.values.sort.reverse}"
    assert_operator per_worker.values.max, :<=, 6, "connections per worker: #{per_worker.values.sort.reverse}"
  end

  def assert_spread(workers:, clients:, most:)
    server = serve("busy.ru", "-w", workers.to_s, env: { "BUSY_MS" => "5" })
    wait_for_line(server, /worker #{workers - 1} .*ready|serving/) # the workers are up
    @clients = Clients.new(self, server[:port], clients)
    @clients.wait_for(10)
    counts = @clients.during(20 * clients)
    per_worker = @clients.last_pids.tally
    assert_operator per_worker.values.max, :<=, most, "connections per worker: #{per_worker.values.sort.reverse}"
    assert_equal workers, per_worker.size, "connections per worker: #{per_worker.values.sort.reverse}"
    assert_fair_shares(counts)
  end

  # Each client had at least a third of the mean share of answers.
  def assert_fair_shares(counts)
    mean = counts.sum.fdiv(counts.size)
    assert_operator counts.min, :>=, mean / 3, "answers per client in the window: #{counts.sort}"
  end
end
