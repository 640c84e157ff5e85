# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/child_processes"
require "neverblock/server"
require "timeout"
require "net/http"
require "json"
require "tmpdir"
require "fileutils"

# A herd of identical GETs fired at once, with the adaptive request limit on
# (the default): the followers give their request slots back while they wait
# (env["neverblock.mark_as_io_bound"]), so every request of the herd is
# admitted while the one call runs and joins it. Before, the followers waited
# for admission until the leader's answer was gone and then led again: 2
# upstream calls for 200 requests against a 0.3 s upstream.
#
# 200 and 2,000 requests (the report had 200 against a 0.3 s upstream): the
# upstream answers once the server reports the whole herd in flight (at most
# 15 s), as parsing even 200 requests on a loaded 2-core machine can take
# longer than 0.3 s (and a request arriving after the answer rightly leads
# again: seen in CI with three suites at once); before the fix the herd never
# got in flight and a second call followed.
class HerdAdmissionTest < PlainTest
  include ChildProcesses
  EXE = File.expand_path("../../../exe/neverblock", __dir__)
  FIXTURE = File.expand_path("../../fixtures/server/debounced.ru", __dir__)
  STATUS = "/_neverblock"

  def setup
    @calls = Queue.new
    @release = Queue.new
    calls = @calls
    release = @release
    app = lambda do |_env|
      calls << true
      deadline = NeverBlock::Clock.now + 15
      sleep 0.02 while release.empty? && NeverBlock::Clock.now < deadline
      [200, { "content-type" => "text/plain", "content-length" => "5" }, ["slow\n"]]
    end
    @upstream = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0)
    @upstream_url = @upstream.bound_addresses.first.sub("tcp://", "http://")
    @upstream_thread = Thread.new { @upstream.run }
    @children = []
    @dir = Dir.mktmpdir("herd")
  end

  def teardown
    stop_children(@children)
    @upstream.stop
    @upstream_thread.join(20)
    FileUtils.rm_rf(@dir)
    super
  end

  def test_200_identical_gets_through_neverblock_debounce_cost_one_upstream_call
    assert_one_upstream_call_through_debounce(200)
  end

  def test_2000_identical_gets_through_neverblock_debounce_cost_one_upstream_call
    assert_one_upstream_call_through_debounce(2000)
  end

  def test_200_identical_gets_through_the_debouncer_middleware_under_neverblock_serve_cost_one_call
    assert_one_call_through_the_middleware(200)
  end

  def test_2000_identical_gets_through_the_debouncer_middleware_under_neverblock_serve_cost_one_call
    assert_one_call_through_the_middleware(2000)
  end

  private

  def assert_one_upstream_call_through_debounce(count)
    port = start("debounce", "--upstream", @upstream_url, "--listen", "tcp://127.0.0.1:0", "--workers", "1",
                 "--status", STATUS)
    assert_one_leader(herd(count, port) { @release << true })
    assert_equal 1, @calls.size, "upstream calls"
  end

  def assert_one_call_through_the_middleware(count)
    file = File.join(@dir, "release")
    port = start("serve", FIXTURE, "-b", "tcp://127.0.0.1:0", "-w", "1", "--status", STATUS,
                 env: { "HERD_RELEASE_FILE" => file })
    assert_one_leader(herd(count, port) { File.write(file, "") })
  end

  # Starts `neverblock ARGS` and returns the port it printed.
  def start(*args, env: {})
    reader, writer = IO.pipe
    pid = Process.spawn(env, RbConfig.ruby, EXE, *args, out: writer, err: writer)
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

  # `count` clients, each on its own connection, send the same GET, each as
  # soon as it is connected. The upstream holds its answer until the whole
  # herd is in flight, so the herd meets the one call however long the
  # connecting takes. (Opening every connection first and writing after
  # reset some on a loaded machine: 2,000 connects took longer than the
  # server's 5 s idle_timeout, which rightly closed the first connections,
  # still silent, before their requests came.)
  # With a block: calls it (to release the upstream) once the server reports
  # every request in flight, or after 15 s.
  def herd(count, port, &release)
    request = "GET /config HTTP/1.1\r\nHost: config.internal\r\nConnection: close\r\n\r\n"
    NeverBlock.run do
      sockets = NeverBlock.map(1..count, concurrency: 200) do
        TCPSocket.new("127.0.0.1", port).tap { |socket| socket.write(request) }
      end
      readers = sockets.map { |socket| NeverBlock.spawn { socket.read.tap { socket.close } } }
      if release
        deadline = now + 15
        NeverBlock.sleep(0.05) until in_flight(port) >= count || now > deadline
        release.call
      end
      NeverBlock.wait_all(readers)
    end
  end

  # Requests the server reports in flight (its status request not counted).
  def in_flight(port)
    response = Net::HTTP.start("127.0.0.1", port, read_timeout: 2) { |http| http.get(STATUS) }
    JSON.parse(response.body).fetch("requests_in_flight") - 1
  rescue Net::ReadTimeout, SystemCallError, JSON::ParserError
    0
  end

  def assert_one_leader(responses)
    statuses = responses.map { |response| response[/\AHTTP\/1.1 (\d+)/, 1] }.tally
    assert_equal({ "200" => responses.size }, statuses)
    roles = responses.map { |response| response[/^x-debounce: (\w+)/i, 1] }.tally
    assert_equal({ "leader" => 1, "follower" => responses.size - 1 }, roles, "one upstream call for the herd")
    assert_equal 1, responses.map { |response| response.split("\r\n\r\n", 2).last }.uniq.size, "one answer"
  end
end
