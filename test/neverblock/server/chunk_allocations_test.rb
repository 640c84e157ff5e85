# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"
require "socket"

# A chunked body's chunks are framed in one String the response reuses: an
# event stream's events cost the server no object each, which at thousands
# of streams kept minor GCs (each scanning every stream's fiber stack)
# frequent. Allocation counts are exact, whatever the machine's load.
class ChunkAllocationsTest < PlainTest
  Request = Struct.new(:head, :http10, :env)
  CHUNKS = 500

  def test_a_chunked_body_allocates_no_object_per_chunk
    reader, writer = UNIXSocket.pair
    response = NeverBlock::Server::Response.new(writer, 5)
    request = Request.new(false, false, {})
    chunks = Array.new(CHUNKS) { |index| "data: {\"index\":#{index}}\n\n" }
    body = Struct.new(:chunks) { def each(&block) = chunks.each(&block) }.new(chunks)
    drain = Thread.new { reader.read }
    # A first response builds its constants and caches: counted is the second.
    response.write(request, 200, { "content-type" => "text/event-stream" }, body, true)
    before = GC.stat(:total_allocated_objects)
    response.write(request, 200, { "content-type" => "text/event-stream" }, body, true)
    allocated = GC.stat(:total_allocated_objects) - before
    assert_operator allocated, :<, CHUNKS / 10, "objects allocated writing #{CHUNKS} chunks"
    writer.close
    text = drain.value
    assert_equal 2, text.scan("HTTP/1.1 200 OK").size
    assert_equal CHUNKS * 2, text.scan(/^data: /).size
    assert text.end_with?("0\r\n\r\n"), "each response ends with its last chunk"
    second = text.split("HTTP/1.1 200 OK").last
    assert_includes second, "#{chunks[7].bytesize.to_s(16)}\r\n#{chunks[7]}\r\n"
    assert_equal 0, response.instance_variable_get(:@chunk_buffer).bytesize, "the last chunk is not kept"
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end

  # An array body's response is one String, its head and body together:
  # its content-length line and the length it checks the body against
  # allocate nothing (they made and parsed a String each).
  def test_an_array_body_allocates_only_its_response_string
    assert_array_body_allocates_one_string(fast_headers: false)
  end

  # The same through the C extension, which makes the head with room for
  # its lines (HTTPHead.head_buffer: String.new's capacity: keyword would
  # allocate a Hash a response) and writes the app's header lines.
  def test_an_array_body_allocates_only_its_response_string_with_the_extension
    skip "no NeverBlock::HTTPHead (the C extension is not built)" unless defined?(NeverBlock::HTTPHead)

    assert_array_body_allocates_one_string(fast_headers: true)
  end

  # A chunked request body: a plain size line is read without a String,
  # and small chunks' data is gathered into one String per read. 1,000
  # one-byte chunks in one read made three objects each.
  def test_a_chunked_request_body_allocates_about_one_object_per_small_chunk
    limits = NeverBlock::Server::Limits.build({})
    head = "POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
    body = Array.new(1000) { |i| "1\r\n#{(97 + (i % 26)).chr}\r\n" }.join
    bytes = "#{head}#{body}0\r\n\r\n".b
    2.times do |round| # (the first fills caches)
      parser = NeverBlock::Server::Parser.new(limits, {}, "localhost", "80", false)
      before = GC.stat(:total_allocated_objects)
      parser << bytes
      allocated = GC.stat(:total_allocated_objects) - before
      assert_equal 1000, parser.requests.first.body_bytes
      assert_operator allocated, :<, 1500, "objects allocated reading 1,000 chunks" if round == 1
    end
  end

  private

  def assert_array_body_allocates_one_string(fast_headers:)
    reader, writer = UNIXSocket.pair
    response = NeverBlock::Server::Response.new(writer, 5, fast_headers)
    request = Request.new(false, false, {})
    headers = { "content-type" => "text/plain" }
    body = ["Hello, world!"]
    drain = Thread.new { reader.read }
    response.write(request, 200, headers, body, true) # (the caches filled)
    before = GC.stat(:total_allocated_objects)
    100.times { response.write(request, 200, headers, body, true) }
    allocated = GC.stat(:total_allocated_objects) - before
    assert_operator allocated, :<, 150, "objects allocated writing 100 responses" # 1 each (a Date line a second)
    writer.close
    text = drain.value
    assert_equal 101, text.scan("content-length: 13\r\n\r\nHello, world!").size
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end
end
