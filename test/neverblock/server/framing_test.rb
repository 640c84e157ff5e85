# frozen_string_literal: true

require_relative "server_helper"

# Message framing: where each request and its body end. A front proxy and
# the server must agree on it byte for byte, or the bytes after a body
# the server misreads become a request the proxy never sent. Checked on the
# Parser with and without the C head parser, whole, at every two-read split
# and a byte at a time, and end to end on a real server.
class ServerFramingTest < PlainTest
  include ServerHelper

  Parser = NeverBlock::Server::Parser
  HTTPError = NeverBlock::Server::HTTPError
  LIMITS = NeverBlock::Server::Limits.build(max_body: 1000)

  CHUNKED = "POST /upload HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
  NEXT = "GET /next HTTP/1.1\r\nHost: a\r\n\r\n"
  SMUGGLED = "GET /smuggled HTTP/1.1\r\nHost: a\r\n\r\n"

  # Parses `pieces` in order with a fresh parser.
  # @return [Array] the refusal's status (nil when none) and [path, body] per request read.
  def parse(pieces, head_parser:)
    parser = Parser.new(LIMITS, {}, "localhost", "80", head_parser)
    status = nil
    pieces.each do |piece|
      parser << piece.b
    rescue HTTPError => e
      status = e.status
      break
    end
    [status, parser.requests.select(&:complete).map { |request| [request.env["PATH_INFO"], request.body.to_s] }]
  end

  # Every way of reading `bytes`: whole, split in two at each byte, a byte at a time.
  def readings(bytes)
    bytes = bytes.b
    [[bytes], bytes.chars] + (1...bytes.bytesize).map { |at| [bytes.byteslice(0, at), bytes.byteslice(at..)] }
  end

  # Asserts `bytes` parse to `expected` ([status, [[path, body], ...]]) on
  # both paths, however they are read.
  def assert_parses(expected, bytes)
    [true, false].each do |head_parser|
      next if head_parser && !Parser.head_parser?

      readings(bytes).each do |pieces|
        assert_equal expected, parse(pieces, head_parser: head_parser),
                     "head_parser: #{head_parser}, reads: #{pieces.inspect[0, 300]}"
      end
    end
  end

  # --- chunked bodies ---------------------------------------------------------

  def test_a_chunked_body_is_decoded_however_it_is_read
    body = "5\r\nhello\r\n1;name=value;flag\r\n \r\n10 ; q=\"a \\\" b\"\r\n0123456789abcdef\r\n0\r\nX-Sum: 1\r\n\r\n"
    assert_parses [nil, [["/upload", "hello 0123456789abcdef"], ["/next", ""]]], CHUNKED + body + NEXT
  end

  def test_chunk_sizes_in_any_case_with_leading_zeros
    assert_parses [nil, [["/upload", "#{'a' * 26}b"]]], "#{CHUNKED}001A\r\n#{'a' * 26}\r\n1\r\nb\r\n000\r\n\r\n"
  end

  # The smuggling case: llhttp 8.1 skipped the two bytes after chunk data.
  def test_chunk_data_not_followed_by_crlf_is_refused
    assert_parses [400, []], "#{CHUNKED}5\r\nhelloXX0\r\n\r\n#{SMUGGLED}"
    assert_parses [400, []], "#{CHUNKED}5\r\nhello\rX0\r\n\r\n#{SMUGGLED}"
    assert_parses [400, []], "#{CHUNKED}5\r\nhello\n0\r\n\r\n#{SMUGGLED}"
  end

  def test_bad_chunk_size_lines_are_refused
    ["zz", "", " 5", "5 ", "-5", "0x5", "+5", "1" * 17, "5;", "5;=x", "5;a=", "5;a b", "5;a=\"open",
     "5;a=\"x\"y", "5\rX", "5;a\x00"].each do |line|
      assert_parses [400, []], "#{CHUNKED}#{line}\r\nhello\r\n0\r\n\r\n"
    end
    assert_parses [400, []], "#{CHUNKED}5\nhello\r\n0\r\n\r\n"
    assert_parses [400, []], "#{CHUNKED}5;#{'a' * 5000}\r\nhello\r\n0\r\n\r\n"
  end

  def test_bad_trailers_are_refused
    ["X-A : b", " X-A: b", "X-A", ": b", "X-A: b\x01", "X-A: b\rc"].each do |trailer|
      assert_parses [400, []], "#{CHUNKED}0\r\n#{trailer}\r\n\r\n"
    end
    assert_parses [400, []], "#{CHUNKED}0\r\nX-A: b\n\r\n"
  end

  def test_trailers_are_checked_and_dropped
    status, requests = parse(["#{CHUNKED}0\r\nX-Trailer: 1\r\nX-Other:\r\n\r\n"], head_parser: false)
    assert_equal [nil, [["/upload", ""]]], [status, requests]
  end

  def test_chunk_sizes_over_max_body_are_refused_before_the_data
    assert_parses [413, []], "#{CHUNKED}3E9\r\n"
    assert_parses [413, []], "#{CHUNKED}200\r\n#{'a' * 512}\r\n200\r\n"
    assert_parses [413, []], "#{CHUNKED}FFFFFFFFFFFFFFFF\r\n"
  end

  def test_too_many_or_too_long_trailers_are_431
    many = Array.new(LIMITS.max_headers + 1) { |i| "X-#{i}: v\r\n" }.join
    assert_equal 431, parse(["#{CHUNKED}0\r\n#{many}\r\n"], head_parser: false).first
    long = "X-Long: #{'v' * LIMITS.max_header_bytes}\r\n"
    assert_equal 431, parse(["#{CHUNKED}0\r\n#{long}\r\n"], head_parser: false).first
  end

  # --- heads ----------------------------------------------------------------

  # llhttp 8.1 (and the C head parser, which followed it) ended a head at
  # `\r\n\r` and any byte, and at `\r\n\n`.
  def test_a_head_ends_only_at_crlf_crlf
    ["GET /a HTTP/1.1\r\nHost: a\r\n\rX#{SMUGGLED}", "GET /a HTTP/1.1\r\nHost: a\r\n\r:#{SMUGGLED}",
     "GET /a HTTP/1.1\r\nHost: a\r\n\n#{SMUGGLED}", "GET /a HTTP/1.1\r\nHost: a\r\n\r\r\n\r\n",
     "POST /a HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\rXhello#{SMUGGLED}"].each do |bytes|
      status, requests = parse([bytes], head_parser: true)
      assert_equal 400, status, bytes.inspect
      assert_empty requests.map(&:first) & ["/smuggled"], bytes.inspect
      assert_parses [400, []], bytes
    end
  end

  # Shapes llhttp 8.1 lets through that a proxy may frame otherwise (found
  # by the differential test, differential_test.rb).
  def test_ambiguous_heads_llhttp_takes_are_refused
    ["POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding:\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
     "POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: \t\r\n\r\n0\r\n\r\n",
     "POST /a HTTP/1.0\r\nConnection: keep-alive\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     "GET /a HTTP/1.1\nHost: a\r\n\r\n", "GET  /a HTTP/1.1\r\nHost: a\r\n\r\n",
     "GET /a  HTTP/1.1\r\nHost: a\r\n\r\n", "GET /a HTTP/1.1\r\nHost: a\r\n: x\r\n\r\n"].each do |bytes|
      [true, false].each do |head_parser|
        assert_equal 400, parse([bytes + SMUGGLED], head_parser: head_parser).first, bytes.inspect
      end
    end
  end

  def test_empty_lines_before_a_request_are_skipped
    assert_parses [nil, [["/next", ""], ["/next", ""]]], "\r\n\r\n#{NEXT}\r\n#{NEXT}"
  end

  def test_content_length_bodies_and_pipelining_however_read
    post = "POST /form HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
    repeated = "POST /form HTTP/1.1\r\nHost: a\r\nX-A: 1\r\nX-A: 2\r\nContent-Length: 3\r\n\r\nabc" # llhttp's head
    assert_parses [nil, [["/form", "hello"], ["/form", "abc"], ["/next", ""]]], post + repeated + NEXT
  end

  def test_nothing_is_read_after_a_request_not_kept_alive
    closing = "POST /last HTTP/1.1\r\nHost: a\r\nConnection: close\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n"
    assert_parses [nil, [["/last", "a"]]], closing + SMUGGLED
  end

  # --- end to end ------------------------------------------------------------

  def test_the_server_refuses_the_smuggling_shapes_and_serves_nothing_after_them
    paths = Queue.new
    start_server(lambda { |env|
      paths << env["PATH_INFO"]
      [200, { "content-length" => "2" }, ["ok"]]
    })
    ["#{CHUNKED}5\r\nhelloXX0\r\n\r\n#{SMUGGLED}", "GET /a HTTP/1.1\r\nHost: a\r\n\rX#{SMUGGLED}",
     "GET /a HTTP/1.1\r\nHost: a\r\n\n#{SMUGGLED}"].each do |bytes|
      response = exchange(bytes)
      assert_match %r{\AHTTP/1\.1 400 }, response, bytes.inspect
      assert_equal 1, response.scan("HTTP/1.1").size, "one response, then the connection closed: #{response.inspect}"
    end
    assert_equal 0, paths.size, "the app saw none of them"
    response = exchange("#{CHUNKED}5\r\nhello\r\n0\r\n\r\n#{NEXT.sub("\r\n\r\n", "\r\nConnection: close\r\n\r\n")}")
    assert_equal 2, response.scan("HTTP/1.1 200").size, response
  end
end
