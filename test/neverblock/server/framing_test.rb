# frozen_string_literal: true

require_relative "server_helper"
require_relative "smuggling_corpus"

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
    parse_with(LIMITS, pieces, head_parser: head_parser)
  end

  def parse_with(limits, pieces, head_parser:)
    parser = Parser.new(limits, {}, "localhost", "80", head_parser)
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

  # Each chunk may bring 16 bytes of framing (size line, extensions, CRLFs)
  # plus twice its size; more than 16 KiB over that allowance is refused.
  # Long extensions on one-byte chunks carry nothing but a regex match per
  # line.
  def test_framing_far_over_its_data_is_refused
    limits = NeverBlock::Server::Limits.build(max_body: 1024 * 1024)
    bloated = "1;#{'e' * 4000}\r\nx\r\n"
    fair = "800;#{'e' * 4000}\r\n#{'y' * 2048}\r\n" # the same extensions on chunks that carry their weight
    [true, false].each do |head_parser|
      read = ->(body) { parse_with(limits, [CHUNKED + body + "0\r\n\r\n"], head_parser: head_parser) }
      assert_equal [nil, [["/upload", "xxx"]]], read.call(bloated * 3)
      assert_equal [400, []], read.call(bloated * 5)
      status, requests = read.call(fair * 20)
      assert_equal [nil, 2048 * 20], [status, requests.first&.last&.bytesize]
      status, requests = read.call("1\r\nz\r\n" * 20_000) # one-byte chunks, 5 bytes of framing each
      assert_equal [nil, 20_000], [status, requests.first&.last&.bytesize]
    end
  end

  # A size line's digits are read up to the 17th, which already refuses
  # it: reading all of a long run first grew a bignum digit by digit
  # (quadratic: 16 KiB of digits took 46 ms, 200 KB seconds).
  def test_a_long_run_of_size_digits_is_refused_at_once
    [true, false].each do |head_parser|
      started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      assert_equal [400, []], parse_with(LIMITS, [CHUNKED + ("f" * 200_000)], head_parser: head_parser)
      elapsed = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
      assert_operator elapsed, :<, 1, "200,000 size digits took #{elapsed.round(2)} s"
    end
  end

  # The data of small chunks is gathered per read: a body of many chunks
  # reads the same in any reads.
  def test_many_small_chunks_read_the_same_in_any_reads
    chunks = Array.new(600) { |i| "#{(i % 40 + 1).to_s(16)};n=#{i}\r\n#{(97 + (i % 26)).chr * (i % 40 + 1)}\r\n" }
    body = chunks.map { |chunk| chunk[/\n(.*)\r\n\z/m, 1] }.join
    bytes = "#{CHUNKED}#{chunks.join}0\r\n\r\n#{NEXT}"
    limits = NeverBlock::Server::Limits.build(max_body: 1024 * 1024)
    [bytes.bytesize, 4096, 97, 7, 1].each do |read|
      pieces = (0...bytes.bytesize).step(read).map { |at| bytes.byteslice(at, read) }
      outcome = parse_with(limits, pieces, head_parser: true)
      assert outcome == [nil, [["/upload", body], ["/next", ""]]], "in #{read}-byte reads: #{outcome.inspect[0, 200]}"
    end
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
    assert_parses [nil, [["/next", ""], ["/next", ""]]], "#{"\r\n" * 4}#{NEXT}#{"\r\n" * 4}#{NEXT}"
  end

  # RFC 9112 2.2 asks a server to ignore at least one; a client that keeps
  # sending them is not making a request.
  def test_more_than_four_empty_lines_before_a_request_are_refused
    assert_parses [400, []], "#{"\r\n" * 5}#{NEXT}"
    assert_parses [400, [["/next", ""]]], "#{NEXT}#{"\r\n" * 5}#{NEXT}"
  end

  # Lines end in CRLF there too: a bare CR or LF is no empty line.
  def test_a_bare_cr_or_lf_before_a_request_is_refused
    ["\n", "\r\r\n", "\r\n\n", "\rGET"].each do |before|
      assert_parses [400, []], "#{before}#{NEXT}"
    end
  end

  def test_empty_lines_only_tells_whether_the_bytes_are_empty_lines_the_parser_takes
    parser = Parser.new(LIMITS, {}, "localhost", "80", false)
    assert parser.at_boundary?
    assert parser.empty_lines_only?("\r\n\r".b)
    parser << "\r\n\r".b
    refute parser.at_boundary?, "it read an empty line and the CR of another"
    assert parser.empty_lines_only?("\n\r\n\r\n".b)
    refute parser.empty_lines_only?("\n\r\n\r\n\r\n".b), "the fifth line is refused by #<<"
    refute parser.empty_lines_only?("\nG".b), "a request begins"
    refute parser.empty_lines_only?("\r".b), "a bare CR"
    parser << "\n#{NEXT}".b
    assert parser.at_boundary?
    assert_equal ["/next"], parser.requests.map { |request| request.env["PATH_INFO"] }
  end

  # --- request lines ---------------------------------------------------------

  # RFC 9112 3: `method SP request-target SP HTTP-version CRLF`; llhttp 8.1
  # takes HTAB and FF in a target (and the fast path declines them).
  def test_control_bytes_in_the_request_target_are_refused
    ["GET /a\tHTTP/1.1 HTTP/1.1", "GET /a\fb HTTP/1.1", "GET /a\vb HTTP/1.1", "GET /a\x7Fb HTTP/1.1",
     "GET /a\x01b HTTP/1.1", "GET\t/a HTTP/1.1", "GET /a HTTP/1.1\t"].each do |line|
      assert_parses [400, []], "#{line}\r\nHost: a\r\n\r\n#{SMUGGLED}"
    end
    assert_parses [nil, [["/caf\xC3\xA9".b, ""]]], "GET /caf\xC3\xA9 HTTP/1.1\r\nHost: a\r\n\r\n" # obs-text stays
  end

  # These were checked only when the whole line came in one read.
  def test_a_malformed_request_line_is_refused_however_it_is_read
    ["GET  /a HTTP/1.1", "GET /a  HTTP/1.1", "GET /a HTTP/1.1 ", " GET /a HTTP/1.1", "GET /a HTTP/1.1\rX"].each do |line|
      assert_parses [400, []], "#{line}\r\nHost: a\r\n\r\n#{SMUGGLED}"
    end
    assert_parses [400, []], "GET /a HTTP/1.1\nHost: a\r\n\r\n#{SMUGGLED}"
  end

  def test_a_request_line_over_the_target_limit_is_414_however_it_is_read
    limits = NeverBlock::Server::Limits.build(max_request_target: 64)
    line_max = 64 + Parser::HeadForm::LINE_SLACK
    [["GET /#{'a' * 63} HTTP/1.1", nil], ["GET /#{'a' * 64} HTTP/1.1", 414], ["GET /#{'a' * line_max}", 414]].each do |line, status|
      bytes = "#{line}\r\nHost: a\r\n\r\n".b
      verdicts = readings(bytes).map { |pieces| parse_with(limits, pieces, head_parser: false).first }.uniq
      assert_equal [status], verdicts, line
    end
  end

  def test_a_header_block_over_the_limit_is_431_however_it_is_read
    limits = NeverBlock::Server::Limits.build(max_header_bytes: 40)
    verdicts = (10..35).map do |pad|
      bytes = "GET / HTTP/1.1\r\nHost: a\r\nX-Pad: #{'p' * pad}\r\n\r\n".b
      statuses = readings(bytes).map { |pieces| parse_with(limits, pieces, head_parser: false).first }.uniq
      assert_equal 1, statuses.size, "one verdict for a #{pad}-byte value: #{statuses}"
      statuses.first
    end
    assert_equal [nil, 431], verdicts.uniq, "the limit lies within"
  end

  # A head is held until it ends; one that cannot be valid is refused at
  # once, not at header_timeout (it may never end).
  def test_a_head_with_a_bare_cr_or_lf_is_refused_before_it_ends
    ["GET / HTTP/1.1\r\nHost: a\nX-A: b", "GET / HTTP/1.1\r\nHost: a\r\n\rX", "GET /a\rb", "GET /a\nb",
     "GET / HTTP/1.1\r\nHost: a\rX-A: b"].each do |bytes|
      assert_parses [400, []], bytes
    end
  end

  # --- header values ------------------------------------------------------------

  # OWS is SP or HTAB (RFC 9110 5.6.3); llhttp 8.1 refused `5\t`.
  def test_blanks_after_a_content_length_may_be_tabs
    assert_parses [nil, [["/form", "hello"], ["/next", ""]]], "POST /form HTTP/1.1\r\nHost: a\r\nContent-Length: 5\t\r\n\r\nhello#{NEXT}"
    assert_parses [nil, [["/form", "hello"]]], "POST /form HTTP/1.1\r\nHost: a\r\nContent-Length:\t5 \t \r\n\r\nhello"
    assert_parses [400, []], "POST /form HTTP/1.1\r\nHost: a\r\nContent-Length: 5\t5\r\n\r\nhello"
  end

  # RFC 9112 5.2: a server rejects obs-fold (or replaces it); llhttp took it
  # after an empty value as the value.
  def test_a_header_line_continued_on_the_next_is_refused
    ["X:\r\n b", "X: \r\n\tb", "X: a\r\n b", "X:\t\r\n \r\nY: c"].each do |header|
      assert_parses [400, []], "GET /a HTTP/1.1\r\nHost: a\r\n#{header}\r\n\r\n#{SMUGGLED}"
    end
    assert_parses [400, []], "GET /a HTTP/1.1\r\n Host: a\r\n\r\n#{SMUGGLED}"
  end

  def test_tabs_inside_a_value_are_kept
    parser = Parser.new(LIMITS, {}, "localhost", "80", false)
    parser << "GET / HTTP/1.1\r\nHost: a\r\nX-A: \ta\tb \t\r\n\r\n".b
    assert_equal "a\tb", parser.requests.first.env["HTTP_X_A"]
  end

  # bin/fuzz found it: the trailing-OWS reading scanned each HTAB's run of
  # blanks again from the next HTAB, so a value of 54,000 HTABs before a
  # word held a connection's loop for a minute (quadratic in the run), within
  # the default max_header_bytes, and with the C head parser on too for any
  # head it leaves to llhttp (here: a Connection list). Read once, it takes
  # milliseconds; 5 s allows any machine.
  def test_a_long_run_of_tabs_inside_a_value_is_read_once
    [[true, ""], [false, ""], [true, "Connection: keep-alive, te\r\n"]].each do |head_parser, declined|
      parser = Parser.new(NeverBlock::Server::Limits.build({}), {}, "localhost", "80", head_parser)
      started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      parser << "GET / HTTP/1.1\r\nHost: a\r\n#{declined}X-A: a#{"\t" * 40_000}b\r\nX-B: #{"\t" * 20_000}\r\n\r\n".b
      elapsed = Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
      env = parser.requests.first.env
      assert_equal "a#{"\t" * 40_000}b", env["HTTP_X_A"]
      assert_equal "", env["HTTP_X_B"]
      assert_operator elapsed, :<, 5, "a head with 60,000 HTABs took #{elapsed.round(1)} s " \
                                      "(head_parser: #{head_parser}#{', one it declines' unless declined.empty?})"
    end
  end

  # --- transfer codings ---------------------------------------------------------

  # The server decodes chunked only; the app is never given a body in a
  # coding nothing tells it of.
  def test_transfer_codings_other_than_chunked_are_501
    ["identity, chunked", "gzip, chunked", "x-custom,chunked", "deflate , gzip, chunked"].each do |coding|
      assert_parses [501, []], "POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: #{coding}\r\n\r\n5\r\nhello\r\n0\r\n\r\n#{NEXT}"
    end
    assert_parses [501, []], "POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
  end

  def test_transfer_codings_that_leave_the_length_unknown_are_400
    ["chunked, chunked", "chunked, gzip", "identity", "gzip", "\"chunked\"", ","].each do |coding|
      assert_parses [400, []], "POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: #{coding}\r\n\r\n0\r\n\r\n#{NEXT}"
    end
  end

  def test_chunked_in_any_case_with_blanks_and_empty_list_elements_is_chunked
    ["chunked", "CHUNKED", "chunked\t", " ,chunked", ", chunked"].each do |coding|
      assert_parses [nil, [["/a", "hello"], ["/next", ""]]],
                    "POST /a HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: #{coding}\r\n\r\n5\r\nhello\r\n0\r\n\r\n#{NEXT}"
    end
  end

  # --- the smuggling corpus -----------------------------------------------------

  # One verdict per request: every case of the corpus parses the same
  # whole as in two reads split anywhere in its head (its first 300
  # bytes), at every 13th byte of the next 1,200 and in its last 8 (chunked
  # bodies are split everywhere above), with and without the C head parser.
  def test_every_corpus_case_parses_the_same_however_it_is_split
    limits = NeverBlock::Server::Limits.build({})
    SmugglingCorpus::CASES.each do |kase|
      bytes = kase.bytes
      size = bytes.bytesize
      head = [bytes.index("\r\n\r\n", 8) || size, 300].min + 4
      splits = (1...size).select { |at| at <= head || ((at % 13).zero? && at < 1500) || at > size - 8 }
      [false, Parser.head_parser?].uniq.each do |head_parser|
        whole = parse_with(limits, [bytes], head_parser: head_parser)
        splits.each do |at|
          pieces = [bytes.byteslice(0, at), bytes.byteslice(at, size - at)]
          assert_equal whole, parse_with(limits, pieces, head_parser: head_parser),
                       -> { "#{kase.name} split at #{at} (head_parser: #{head_parser}): #{pieces.inspect[0, 300]}" }
        end
      end
    end
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
