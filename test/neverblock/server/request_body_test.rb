# frozen_string_literal: true

require_relative "server_helper"
require "digest"

# Request bodies: small ones stay in memory, larger ones go to an unlinked
# Tempfile that is closed once the request is answered.
class ServerRequestBodyTest < PlainTest
  include ServerHelper

  BIG = 2 * 1024 * 1024

  # Answers with the body's size and SHA-256, and how many spooled-body
  # files this process had open while the app ran.
  DIGEST = lambda do |env|
    input = env["rack.input"]
    digest = Digest::SHA256.new
    while (chunk = input.read(65_536))
      digest << chunk
    end
    body = "#{env['CONTENT_LENGTH']} #{digest.hexdigest} #{ServerRequestBodyTest.spooled_files}"
    [200, { "content-length" => body.bytesize.to_s }, [body]]
  end

  # Open files of this process that are spooled request bodies.
  def self.spooled_files
    Dir.children("/proc/self/fd").count do |fd|
      File.readlink("/proc/self/fd/#{fd}").include?("neverblock-body")
    rescue SystemCallError
      false
    end
  end

  def upload(body, chunked: false)
    socket = connect
    if chunked
      socket.write("POST /up HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\n")
      (0...body.bytesize).step(100_000) do |offset|
        part = body.byteslice(offset, 100_000)
        socket.write("#{part.bytesize.to_s(16)}\r\n#{part}\r\n")
      end
      socket.write("0\r\n\r\n")
    else
      socket.write("POST /up HTTP/1.1\r\nHost: localhost\r\nContent-Length: #{body.bytesize}\r\n\r\n#{body}")
    end
    status, _headers, response = read_response(socket)
    assert_equal 200, status
    response.split
  ensure
    socket&.close
  end

  def test_a_large_content_length_body_goes_to_a_tempfile_and_arrives_intact
    baseline = fd_count
    start_server(DIGEST)
    body = Random.new(1).bytes(BIG)
    assert_equal [BIG.to_s, Digest::SHA256.hexdigest(body), "1"], upload(body)
    eventually { self.class.spooled_files.zero? }
    @server.stop
    assert @server_thread.join(10)
    # At most the baseline: an IO of an earlier test that the GC finalizes
    # meanwhile lowers the count without anything of this test leaking.
    assert_operator fd_count, :<=, baseline, "file descriptors leaked"
  end

  def test_a_large_chunked_body_goes_to_a_tempfile_and_arrives_intact
    start_server(DIGEST)
    body = Random.new(2).bytes(BIG)
    assert_equal [BIG.to_s, Digest::SHA256.hexdigest(body), "1"], upload(body, chunked: true)
    eventually { self.class.spooled_files.zero? }
  end

  def test_a_body_up_to_max_body_in_memory_stays_in_memory
    start_server(DIGEST, max_body_in_memory: 1000)
    body = "x" * 1000
    assert_equal ["1000", Digest::SHA256.hexdigest(body), "0"], upload(body)
    body = "x" * 1001
    assert_equal ["1001", Digest::SHA256.hexdigest(body), "1"], upload(body)
  end

  def test_a_spooled_body_reads_like_any_rack_input
    app = lambda do |env|
      input = env["rack.input"]
      first = input.gets
      second = input.read(7)
      binary = second.encoding == Encoding::BINARY
      lines = 2
      input.each { lines += 1 }
      body = "#{first.chomp} #{second.chomp} #{lines} #{binary}"
      [200, { "content-length" => body.bytesize.to_s }, [body]]
    end
    start_server(app, max_body_in_memory: 100)
    body = (1..1000).map { |i| "line #{i}\n" }.join
    assert_equal ["line", "1", "line", "2", "1000", "true"], upload(body)
  end

  def test_a_client_that_leaves_mid_upload_leaves_no_file_open
    start_server(DIGEST)
    socket = connect
    socket.write("POST /up HTTP/1.1\r\nHost: localhost\r\nContent-Length: #{BIG}\r\n\r\n")
    socket.write("x" * (BIG / 2))
    eventually { self.class.spooled_files == 1 }
    socket.close
    eventually { self.class.spooled_files.zero? && @server.stats[:connections].zero? }
  end
end
