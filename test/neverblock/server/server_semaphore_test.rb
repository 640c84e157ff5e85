# frozen_string_literal: true

require_relative "../../test_helper"
require "socket"
require "tmpdir"
require "fileutils"
require "securerandom"
require_relative "../../support/serve_processes"
require_relative "../../support/counting_upstream"
require "neverblock/server"

# A NeverBlock::ServerSemaphore bounding a whole `neverblock serve -w 2`:
# the upstream the app calls counts the calls it serves at once, and never
# sees more than the limit; a worker killed while it holds permits gives them
# back, and the server goes on calling the upstream.
class ServerSemaphoreServerTest < PlainTest
  include ServeProcesses

  def setup
    @dir = Dir.mktmpdir("neverblock-semaphore")
    @name = "server-#{SecureRandom.hex(4)}"
    @upstream = CountingUpstream.new(hold: 0.2)
  end

  def teardown
    super
    @upstream&.close
    FileUtils.rm_rf(@dir)
  end

  def start_server(*args)
    env = { "NB_SEMAPHORE_NAME" => @name, "NB_SEMAPHORE_DIR" => @dir, "NB_UPSTREAM_PORT" => @upstream.port.to_s }
    server = serve("semaphore.ru", "-w", "2", *args, env: env)
    eventually { worker_pids(server[:pid]).size == 2 }
    server
  end

  def test_two_workers_never_call_the_upstream_more_than_the_limit_at_once
    server = start_server
    assert_bounded(calls(server, 24), 24)
  end

  # Workers forked from a mold (a worker that used the semaphore) share it
  # with each other, as the workers forked from the master did.
  def test_a_reforked_generation_shares_the_bound
    skip NeverBlock::Server::Cluster::Refork.unavailable if NeverBlock::Server::Cluster::Refork.unavailable

    server = start_server("--refork-after", "12,false")
    first_generation = worker_pids(server[:pid])
    calls(server, 24) # a worker passes 12 requests: it becomes the mold
    mold = Integer(wait_for_line(server, /\(pid (\d+)\) is the mold/, timeout: 60)[/\(pid (\d+)\) is the mold/, 1])
    eventually do
      workers = worker_pids(server[:pid]) - [mold]
      workers.size == 2 && (workers & first_generation).empty?
    end
    @upstream.reset
    answers = calls(server, 24)
    assert_empty answers.map { |answer| Integer(answer.body.split.first) }.uniq & first_generation
    assert_bounded(answers, 24)
  end

  def test_a_worker_killed_while_it_holds_permits_gives_them_back
    server = start_server
    semaphore = NeverBlock::ServerSemaphore.new(@name, 3, directory: @dir)
    # Raw requests: Net::HTTP would send a GET again when its worker dies.
    holds = Array.new(3) do
      Thread.new do
        TCPSocket.open("127.0.0.1", server[:port]) do |socket|
          socket.write("GET /hold HTTP/1.1\r\nhost: test\r\n\r\n")
          socket.read # until the worker dies
        end
      rescue SystemCallError
        nil
      end
    end
    holders = eventually { (pids = semaphore.holder_pids).size == 3 && pids.uniq }
    assert_empty holders - worker_pids(server[:pid])
    assert_equal 0, semaphore.available

    holders.each { |pid| Process.kill(:KILL, pid) }
    holds.each(&:join)
    eventually { worker_pids(server[:pid]).size == 2 && (worker_pids(server[:pid]) & holders).empty? }
    assert_equal 3, semaphore.available
    answers = calls(server, 6)
    assert_equal ["200"], answers.map(&:code).uniq
    assert_operator @upstream.most, :<=, 3
  end

  private

  # `count` GET /call at once. @return [Array<Net::HTTPResponse>]
  def calls(server, count)
    Array.new(count) { Thread.new { get(server, "/call") } }.map(&:value)
  end

  # Every call answered, by both workers, and the upstream never served
  # more than 3 at once (nor one at a time only).
  def assert_bounded(answers, count)
    assert_equal ["200"], answers.map(&:code).uniq, answers.map(&:body).uniq.join
    workers = answers.map { |answer| Integer(answer.body.split.first) }.uniq
    assert_equal 2, workers.size, "both workers served calls (else a per-process bound would pass too)"
    assert_equal count, @upstream.calls
    assert_operator @upstream.most, :<=, 3, "the upstream served more calls at once than the limit"
    assert_operator @upstream.most, :>=, 2, "the calls were serialized"
  end
end
