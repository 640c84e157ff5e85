# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require_relative "../../support/raw_response"
require "securerandom"
require "tmpdir"
require "zlib"
require "stringio"
require "socket"
require "pg"

# Behind Thruster, as Rails 8's Dockerfile runs an app (`./bin/thrust
# ./bin/rails server`): the real Thruster binary (the thruster gem) starts
# `neverblock serve` with PORT set, and proxies to it.
class ServerThrusterTest < PlainTest
  include ServeProcesses
  include NeverBlockTest::Databases

  def setup
    super
    @dir = Dir.mktmpdir("nb-thruster")
    @file = File.join(@dir, "download.bin")
    File.binwrite(@file, SecureRandom.random_bytes(3 * 1024 * 1024))
    @port = free_port
    reader, writer = IO.pipe
    env = { "HTTP_PORT" => @port.to_s, "TARGET_PORT" => free_port.to_s, "DATABASE_URL" => pg_url, "NB_SENDFILE" => @file }
    # No -b: neverblock serve takes the PORT Thruster sets.
    pid = Process.spawn(env, RbConfig.ruby, Gem.bin_path("thruster", "thrust"),
                        RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "thruster.ru"), "-w", "1", "--access-log",
                        out: writer, err: writer, pgroup: true)
    writer.close
    @thruster = { pid: pid, out: reader, lines: [] }
    (@servers ||= []) << @thruster
    wait_for_line(@thruster, /NeverBlock .* serving .* on tcp:\/\/0\.0\.0\.0:#{env['TARGET_PORT']}/, timeout: 30)
  end

  def teardown
    super
    FileUtils.rm_rf(@dir)
  end

  def test_twenty_one_second_queries_through_thruster_take_about_a_second
    started = NeverBlock::Clock.now
    bodies = Array.new(20) { Thread.new { request("/sleep").body } }.map(&:value)
    took = NeverBlock::Clock.now - started
    assert_equal ["slept 127.0.0.1\n"] * 20, bodies, "answered by the app, with Thruster's X-Forwarded-For"
    assert_operator took, :<, 5, "twenty pg_sleep(1) through Thruster took #{took.round(2)} s: not concurrent"
  end

  def test_thruster_serves_the_file_the_app_names_with_x_sendfile
    response = request("/file")
    assert_equal "200", response.code
    assert_equal File.binread(@file), response.body.b
    assert_nil response["x-sendfile"], "Thruster consumed the header"
    line = wait_for_line(@thruster, %r{"GET /file HTTP/1\.1" 200 })
    assert_match(%r{"GET /file HTTP/1\.1" 200 0 }, line, "the app sent no body: Thruster read the file")
  end

  # Thruster (Go's reverse proxy) closes its upstream connection when its
  # client goes, so the request is cancelled here too, its query with it.
  def test_a_client_that_hangs_up_on_thruster_gets_its_request_cancelled
    socket = TCPSocket.new("127.0.0.1", @port)
    socket.write("GET /hang HTTP/1.1\r\nHost: localhost\r\n\r\n")
    wait_until_running("SELECT pg_sleep(10)")
    socket.close
    line = wait_for_line(@thruster, %r{"GET /hang HTTP/1\.1" 499 }, timeout: 30)
    assert_match(/ 499 /, line, "the access log shows the hang-up")
  end

  # Thruster compresses text/event-stream for a client that accepts gzip,
  # and passes each event on as it comes: the first arrives long before the
  # stream ends. A client that hangs up mid-stream has its stream cancelled.
  def test_server_sent_events_pass_through_thruster_as_they_come_gzip_included
    socket = TCPSocket.new("127.0.0.1", @port)
    started = NeverBlock::Clock.now
    socket.write("GET /events?n=20 HTTP/1.1\r\nHost: localhost\r\nAccept-Encoding: gzip\r\n\r\n")
    first_body = nil
    data = +""
    until data.end_with?("\r\n0\r\n\r\n")
      assert socket.wait_readable(30), "the stream stalled; got:\n#{data.inspect}"
      chunk = socket.readpartial(65_536)
      data << chunk
      first_body ||= NeverBlock::Clock.now - started if data.include?("\r\n\r\n") && !data.end_with?("\r\n\r\n")
    end
    took = NeverBlock::Clock.now - started
    head, body = data.split("\r\n\r\n", 2)
    assert_match(/^content-encoding: gzip\r?$/i, head)
    assert_equal (0...20).map { |index| "data: event #{index}\n\n" }.join, gunzip(RawResponse.dechunk(body))
    assert_operator took, :>=, 1.9, "twenty events 100 ms apart"
    assert_operator first_body, :<, took / 2, "the first event came at #{first_body.round(2)} s of #{took.round(2)}: buffered"
  ensure
    socket&.close
  end

  def test_a_client_that_hangs_up_mid_stream_on_thruster_gets_its_stream_cancelled
    socket = TCPSocket.new("127.0.0.1", @port)
    socket.write("GET /events?n=600 HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert_includes socket.readpartial(65_536), "200"
    sleep 0.3
    socket.close
    line = wait_for_line(@thruster, %r{"GET /events\?n=600 HTTP/1\.1" 499 }, timeout: 30)
    assert_match(/ 499 /, line, "the access log shows the hang-up, long before the stream's 60 s")
  end

  private

  # Waits until PostgreSQL runs `query` (Thruster passed the request on, and
  # the app got to it), seen from a connection of the test's own.
  def wait_until_running(query)
    PG.connect(pg_url) do |observer|
      deadline = NeverBlock::Clock.now + 30
      until observer.exec_params("SELECT 1 FROM pg_stat_activity WHERE state = 'active' AND query = $1", [query]).ntuples == 1
        flunk "#{query} never ran:\n#{@thruster[:lines].join}" if NeverBlock::Clock.now > deadline
        sleep 0.05
      end
    end
  end

  def gunzip(data)
    Zlib::GzipReader.new(StringIO.new(data)).read
  end

  def request(path)
    Net::HTTP.start("127.0.0.1", @port, open_timeout: 5, read_timeout: 30) { |http| http.get(path) }
  end
end
