# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"
require "timeout"

# A herd of identical GETs fired at once, with the adaptive request limit on
# (the default) and an upstream that takes 0.3 s, not held until the herd has
# arrived: the followers give their request slots back while they wait
# (env["neverblock.mark_as_io_bound"]), so every request of the herd is
# admitted while the one call runs and joins it. Before, the followers waited
# for admission until the leader's answer was gone and then led again: 2
# upstream calls for 200 requests.
class HerdAdmissionTest < PlainTest
  EXE = File.expand_path("../../../exe/neverblock", __dir__)
  FIXTURE = File.expand_path("../../fixtures/server/debounced.ru", __dir__)

  def setup
    @calls = Queue.new
    calls = @calls
    app = lambda do |_env|
      calls << true
      sleep 0.3
      [200, { "content-type" => "text/plain", "content-length" => "5" }, ["slow\n"]]
    end
    @upstream = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0)
    @upstream_url = @upstream.bound_addresses.first.sub("tcp://", "http://")
    @upstream_thread = Thread.new { @upstream.run }
    @children = []
  end

  def teardown
    @children.each do |child|
      Process.kill("TERM", child[:pid])
      Timeout.timeout(20) { Process.wait(child[:pid]) }
    rescue Errno::ESRCH, Errno::ECHILD
      nil
    rescue Timeout::Error
      Process.kill("KILL", child[:pid])
      Process.wait(child[:pid])
    ensure
      child[:out].close
    end
    @upstream.stop
    @upstream_thread.join(20)
    super
  end

  def test_200_identical_gets_through_neverblock_debounce_cost_one_upstream_call
    port = start("debounce", "--upstream", @upstream_url, "--listen", "tcp://127.0.0.1:0", "--workers", "1")
    assert_one_leader(herd(200, port))
    assert_equal 1, @calls.size, "upstream calls"
  end

  def test_2000_identical_gets_through_neverblock_debounce_cost_one_upstream_call
    port = start("debounce", "--upstream", @upstream_url, "--listen", "tcp://127.0.0.1:0", "--workers", "1")
    assert_one_leader(herd(2000, port))
    assert_equal 1, @calls.size, "upstream calls"
  end

  def test_200_identical_gets_through_the_debouncer_middleware_under_neverblock_serve_cost_one_call
    assert_one_leader(herd(200, start("serve", FIXTURE, "-b", "tcp://127.0.0.1:0", "-w", "1")))
  end

  def test_2000_identical_gets_through_the_debouncer_middleware_under_neverblock_serve_cost_one_call
    assert_one_leader(herd(2000, start("serve", FIXTURE, "-b", "tcp://127.0.0.1:0", "-w", "1")))
  end

  private

  # Starts `neverblock ARGS` and returns the port it printed.
  def start(*args)
    reader, writer = IO.pipe
    pid = Process.spawn(RbConfig.ruby, EXE, *args, out: writer, err: writer)
    writer.close
    child = { pid: pid, out: reader }
    @children << child
    Timeout.timeout(60) do
      while (line = reader.gets)
        port = line[%r{on tcp://127\.0\.0\.1:(\d+)}, 1]
        return Integer(port) if port
      end
    end
    flunk "neverblock #{args.first} exited before it listened"
  end

  # `count` clients, each on its own connection, send the same GET at once:
  # every connection is opened first, then every request written in one go (a
  # herd arriving over longer than the upstream's 0.3 s would rightly cost a
  # second call for its late part).
  def herd(count, port)
    NeverBlock.run do
      sockets = NeverBlock.map(1..count, concurrency: 200) { TCPSocket.new("127.0.0.1", port) }
      request = "GET /config HTTP/1.1\r\nHost: config.internal\r\nConnection: close\r\n\r\n"
      sockets.each { |socket| socket.write(request) }
      NeverBlock.wait_all(sockets.map { |socket| NeverBlock.spawn { socket.read.tap { socket.close } } })
    end
  end

  def assert_one_leader(responses)
    statuses = responses.map { |response| response[/\AHTTP\/1.1 (\d+)/, 1] }.tally
    assert_equal({ "200" => responses.size }, statuses)
    roles = responses.map { |response| response[/^x-debounce: (\w+)/i, 1] }.tally
    assert_equal({ "leader" => 1, "follower" => responses.size - 1 }, roles, "one upstream call for the herd")
    assert_equal 1, responses.map { |response| response.split("\r\n\r\n", 2).last }.uniq.size, "one answer"
  end
end
