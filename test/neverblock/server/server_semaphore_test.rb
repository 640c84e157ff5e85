# frozen_string_literal: true

require_relative "../../test_helper"
require "socket"
require "tmpdir"
require "fileutils"
require "securerandom"
require_relative "../../support/serve_processes"
require_relative "../../support/counting_upstream"

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

  def start_server
    env = { "NB_SEMAPHORE_NAME" => @name, "NB_SEMAPHORE_DIR" => @dir, "NB_UPSTREAM_PORT" => @upstream.port.to_s }
    server = serve("semaphore.ru", "-w", "2", env: env)
    eventually { worker_pids(server[:pid]).size == 2 }
    server
  end

  def test_two_workers_never_call_the_upstream_more_than_the_limit_at_once
    server = start_server
    answers = Array.new(24) { Thread.new { get(server, "/call") } }.map(&:value)
    assert_equal ["200"], answers.map(&:code).uniq, answers.map(&:body).uniq.join
    workers = answers.map { |answer| Integer(answer.body.split.first) }.uniq
    assert_equal 2, workers.size, "both workers served calls (else a per-process bound would pass too)"
    assert_equal 24, @upstream.calls
    assert_operator @upstream.most, :<=, 3, "the upstream served more calls at once than the limit"
    assert_operator @upstream.most, :>=, 2, "the calls were serialized"
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
    answers = Array.new(6) { Thread.new { get(server, "/call") } }.map(&:value)
    assert_equal ["200"], answers.map(&:code).uniq
    assert_operator @upstream.most, :<=, 3
  end
end
