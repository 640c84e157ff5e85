# frozen_string_literal: true

require_relative "../test_helper"
require_relative "../support/child_processes"
require "neverblock/server"
require "timeout"
require "net/http"
require "open3"
require "digest"
require "json"

# `neverblock debounce` as real processes in front of a real upstream: a herd
# of identical requests costs one upstream request, in one proxy process and
# across two that share Redis; every client gets the same answer.
class DebounceProxyTest < PlainTest
  include ChildProcesses
  include NeverBlockTest::Databases

  EXE = File.expand_path("../../exe/neverblock", __dir__)
  HERD = 500

  def setup
    @calls = Queue.new
    @release = Queue.new
    calls = @calls
    release = @release
    app = lambda do |env|
      calls << env["PATH_INFO"]
      return upload(env) if env["PATH_INFO"] == "/upload"
      return download if env["PATH_INFO"].start_with?("/download/")

      release.pop if env["PATH_INFO"] == "/config" # held until the whole herd is waiting
      body = "config v42\n"
      [200, { "content-type" => "text/plain", "x-upstream" => "yes", "cache-control" => "no-store",
              "content-length" => body.bytesize.to_s }, [body]]
    end
    @upstream = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0, fiber_pool: 2000,
                                                max_body: 64 * 1024 * 1024)
    @upstream_url = @upstream.bound_addresses.first.sub("tcp://", "http://")
    @upstream_thread = Thread.new { @upstream.run }
    @proxies = []
  end

  def teardown
    @release << true while @release.num_waiting.positive?
    stop_children(@proxies)
    @upstream.stop
    @upstream_thread.join(20)
    super
  end

  # Reads the whole request body; answers its size and a checksum.
  def upload(env)
    digest = Digest::SHA256.new
    size = 0
    while (chunk = env["rack.input"].read(65_536))
      digest << chunk
      size += chunk.bytesize
    end
    body = "#{size} #{digest.hexdigest}"
    [200, { "content-length" => body.bytesize.to_s }, [body]]
  end

  DOWNLOAD_CHUNK = ("x" * 65_536).freeze
  DOWNLOAD_CHUNKS = 320 # 20 MiB

  def download
    body = Enumerator.new { |y| DOWNLOAD_CHUNKS.times { y << DOWNLOAD_CHUNK } }
    [200, { "content-length" => (DOWNLOAD_CHUNK.bytesize * DOWNLOAD_CHUNKS).to_s, "cache-control" => "no-store" }, body]
  end

  def start_proxy(*args)
    reader, writer = IO.pipe
    pid = Process.spawn(RbConfig.ruby, EXE, "debounce", "--upstream", @upstream_url, "--listen", "tcp://127.0.0.1:0",
                        "-w", "0", "--status", STATUS, *args, out: writer, err: writer)
    writer.close
    proxy = { pid: pid, out: reader }
    @proxies << proxy
    line = Timeout.timeout(30) { reader.gets } or flunk("the proxy exited")
    proxy[:port] = Integer(line[%r{on tcp://127\.0\.0\.1:(\d+)}, 1] || flunk("unexpected first line: #{line}"))
    proxy
  end

  STATUS = "/_status"

  # Requests in the proxies' apps, the status requests that ask not counted.
  def in_flight(ports)
    ports.sum do |port|
      stats = JSON.parse(Net::HTTP.get(URI("http://127.0.0.1:#{port}#{STATUS}")))
      stats.fetch("requests_in_flight") - 1
    end
  end

  # Sends HERD identical GETs at once, spread over the ports; returns the
  # raw responses once the upstream was released.
  def herd(ports)
    responses = nil
    NeverBlock.run do
      tasks = Array.new(HERD) do |i|
        NeverBlock.spawn do
          socket = TCPSocket.new("127.0.0.1", ports[i % ports.size])
          socket.write("GET /config HTTP/1.1\r\nHost: config.internal\r\nConnection: close\r\n\r\n")
          socket.read
        ensure
          socket&.close
        end
      end
      # Release the upstream once every client is waiting on a proxy: on a
      # loaded machine a proxy may take seconds to read the whole herd, and
      # a request it read after the answer would lead a second call.
      NeverBlock.spawn do
        deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 60
        until @calls.size >= 1 && in_flight(ports) >= HERD
          break if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

          NeverBlock.sleep(0.05)
        end
        @release << true
      end
      responses = NeverBlock.wait_all(tasks)
    end
    responses
  end

  def normalize(response)
    head, body = response.split("\r\n\r\n", 2)
    lines = head.split("\r\n")
    headers = lines[1..].reject { |line| line.match?(/\A(date|x-debounce):/i) }.sort
    [lines.first, headers, body]
  end

  def assert_one_answer(responses)
    assert_equal HERD, responses.size
    shapes = responses.map { |response| normalize(response) }.uniq
    assert_equal 1, shapes.size, "every client gets the same status, headers and body: #{shapes.first(2).inspect}"
    status, headers, body = shapes.first
    assert_equal "HTTP/1.1 200 OK", status
    assert_includes headers, "x-upstream: yes"
    assert_equal "config v42\n", body
    roles = responses.map { |response| response[/^x-debounce: (\w+)/i, 1] }.tally
    assert_equal HERD, roles.values.sum
    roles
  end

  def test_one_proxy_process_sends_one_upstream_request_for_a_herd
    proxy = start_proxy
    roles = assert_one_answer(herd([proxy[:port]]))
    assert_equal 1, @calls.size, "upstream requests"
    assert_equal({ "leader" => 1, "follower" => HERD - 1 }, roles)
  end

  def test_two_proxy_processes_sharing_redis_send_one_upstream_request
    first = start_proxy("--redis", redis_url)
    second = start_proxy("--redis", redis_url)
    roles = assert_one_answer(herd([first[:port], second[:port]]))
    assert_equal 1, @calls.size, "upstream requests across both processes"
    assert_equal 1, roles["leader"]
  end

  def test_requests_that_are_not_coalesced_pass_through
    proxy = start_proxy
    response = Net::HTTP.start("127.0.0.1", proxy[:port]) { |http| http.post("/submit", "x=1", "content-type" => "text/plain") }
    assert_equal "200", response.code
    assert_nil response["x-debounce"]
    assert_equal ["/submit"], Array.new(@calls.size) { @calls.pop }
  end

  # Request bodies are not coalesced and pass through whole, past the
  # server's 10 MiB default; --max-body bounds them.
  def test_uploads_over_ten_mib_pass_through_and_max_body_bounds_them
    proxy = start_proxy
    data = Random.new(42).bytes(12 * 1024 * 1024)
    response = Net::HTTP.start("127.0.0.1", proxy[:port], read_timeout: 60) do |http|
      http.post("/upload", data, "content-type" => "application/octet-stream")
    end
    assert_equal "200", response.code, response.body
    assert_equal "#{data.bytesize} #{Digest::SHA256.hexdigest(data)}", response.body

    small = start_proxy("--max-body", "1000")
    response = Net::HTTP.start("127.0.0.1", small[:port]) { |http| http.post("/upload", "x" * 1001) }
    assert_equal "413", response.code
  end

  # 50 concurrent 20 MiB downloads (50 leaders), each announced with a Content-Length
  # over the shared-body limit: they stream from the first byte, so the
  # proxy holds none of them in memory: its RSS grows by a fifth at most of
  # the 1,000 MiB that holding them would take (~70 MB here: 50 streams'
  # buffers). Measured from its RSS after one request, not as an absolute:
  # what the process holds at rest moves with the Ruby and the code loaded.
  def test_large_downloads_stream_without_growing_the_proxy
    proxy = start_proxy
    Net::HTTP.start("127.0.0.1", proxy[:port]) { |http| http.get("/download/warm-up", "host" => "files.internal") }
    before = rss_mb(proxy[:pid])
    clients = Array.new(50) do |i|
      Thread.new do
        socket = TCPSocket.new("127.0.0.1", proxy[:port])
        socket.write("GET /download/#{i} HTTP/1.1\r\nHost: files.internal\r\nConnection: close\r\n\r\n")
        received = 0
        buffer = String.new
        received += buffer.bytesize while socket.read(65_536, buffer)
        received
      ensure
        socket&.close
      end
    end
    peak = 0
    peak = [peak, rss_mb(proxy[:pid])].max while clients.any?(&:alive?) && sleep(0.05)
    sizes = clients.map(&:value)
    assert(sizes.all? { |size| size > DOWNLOAD_CHUNK.bytesize * DOWNLOAD_CHUNKS }, sizes.inspect)
    assert_operator peak - before, :<, 200, "the proxy's RSS went from #{before} MB to #{peak} MB"
  end

  def rss_mb(pid)
    File.read("/proc/#{pid}/status")[/VmRSS:\s+(\d+)/, 1].to_i / 1024
  end

  def test_upstream_down_is_a_502
    port = TCPServer.new("127.0.0.1", 0).then { |server| server.addr[1].tap { server.close } }
    @upstream_url = "http://127.0.0.1:#{port}"
    proxy = start_proxy
    response = Net::HTTP.get_response(URI("http://127.0.0.1:#{proxy[:port]}/config"))
    assert_equal "502", response.code
  end

  def test_usage_errors
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "debounce")
    assert_equal 64, status.exitstatus
    assert_match(/--upstream is required/, out)
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "debounce", "--upstream", "ftp://x")
    assert_equal 64, status.exitstatus
    assert_match(/upstream must be http/, out)
  end
end
