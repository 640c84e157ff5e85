# frozen_string_literal: true

require_relative "server_helper"
require_relative "fuzz_cases"

# The C fast path from a request head to its env (NeverBlock::HTTPHead,
# ext/neverblock/http_head) against the llhttp path it stands in for: fed
# the same bytes, the fast path either declines them or yields exactly the
# env llhttp's callbacks build (the same keys and values, their encodings
# and frozenness), the same body framing and keep-alive; and a Parser with
# the fast path behaves as one without it, whatever the bytes and however
# they are split into reads. Any byte sequence the fast path takes that
# llhttp refuses (a smuggling shape) fails here.
#
# Reproduce a run with its printed seed: NEVERBLOCK_FUZZ_SEED=1234.
class ServerHeadParserTest < PlainTest
  include FuzzCases

  Parser = NeverBlock::Server::Parser
  HTTPError = NeverBlock::Server::HTTPError

  SEED = Integer(ENV.fetch("NEVERBLOCK_FUZZ_SEED", Random.new_seed % 1_000_000_000))
  FUZZ_CASES = 3_000

  # The fuzz test's limits, and bodies kept in memory (compared as Strings).
  LIMITS = NeverBlock::Server::Limits.build(max_body: 64 * 1024, max_header_bytes: 8 * 1024, max_request_target: 2048,
                                            max_headers: 40, max_body_in_memory: 128 * 1024)

  # A connection's env entries, as Connection#base_env makes them (with the
  # early-hints key, which HTTP/1.0 requests lose).
  BASE_ENV = { "SCRIPT_NAME" => "", "REMOTE_ADDR" => "127.0.0.1", "rack.url_scheme" => "http",
               "rack.hijack?" => true, "rack.early_hints" => :early_hints, "SERVER_SOFTWARE" => "NeverBlock" }.freeze

  # Shapes proxies and servers have disagreed on, and others the fast path
  # must leave to llhttp: each is checked against llhttp like every case,
  # and must be declined.
  DECLINED = {
    "CL and TE" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE and CL" => "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 5\r\n\r\n0\r\n\r\n",
    "TE chunked" => "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "TE with a space before the colon" => "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "duplicate CL" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\nhello",
    "different CLs" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
    "CL +5" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +5\r\n\r\nhello",
    "CL -1" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    "CL 5 then a space" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5 \r\n\r\nhello",
    "CL 5 then a tab" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\t\r\n\r\nhello",
    "CL 0x5" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0x5\r\n\r\nhello",
    "CL 5,5" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5,5\r\n\r\nhello",
    "CL empty" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: \r\n\r\n",
    "CL overflowing" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
    "CL over max_body" => "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 65537\r\n\r\n",
    "bare LF" => "GET / HTTP/1.1\nHost: x\n\n",
    "bare LF in a header" => "GET / HTTP/1.1\r\nHost: x\nX: y\r\n\r\n",
    "bare CR" => "GET / HTTP/1.1\r\nHost: x\rX: y\r\n\r\n",
    "NUL in the target" => "GET /a\0b HTTP/1.1\r\nHost: x\r\n\r\n",
    "tab in the target" => "GET /a\tb HTTP/1.1\r\nHost: x\r\n\r\n",
    "CTL in a value" => "GET / HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n",
    "DEL in a value" => "GET / HTTP/1.1\r\nHost: x\r\nX: a\x7Fb\r\n\r\n",
    "NUL in a value" => "GET / HTTP/1.1\r\nHost: x\r\nX: a\0b\r\n\r\n",
    "obs-fold" => "GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n",
    "obs-fold with a tab" => "GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n\tb\r\n\r\n",
    "Host with a space before the colon" => "GET / HTTP/1.1\r\nHost : x\r\n\r\n",
    "Host with a tab before the colon" => "GET / HTTP/1.1\r\nHost\t: x\r\n\r\n",
    "two Hosts" => "GET / HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
    "no Host" => "GET / HTTP/1.1\r\n\r\n",
    "empty Host" => "GET / HTTP/1.1\r\nHost: \r\n\r\n",
    "IPv6 Host" => "GET / HTTP/1.1\r\nHost: [::1]:8080\r\n\r\n",
    "escaped Host" => "GET / HTTP/1.1\r\nHost: %41b\r\n\r\n",
    "Host with a path" => "GET / HTTP/1.1\r\nHost: x/y\r\n\r\n",
    "Host port only" => "GET / HTTP/1.1\r\nHost: :80\r\n\r\n",
    "absolute-form" => "GET http://x/a?b HTTP/1.1\r\nHost: x\r\n\r\n",
    "asterisk-form" => "OPTIONS * HTTP/1.1\r\nHost: x\r\n\r\n",
    "CONNECT" => "CONNECT x:443 HTTP/1.1\r\nHost: x:443\r\n\r\n",
    "Upgrade" => "GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n",
    "Upgrade alone" => "GET / HTTP/1.1\r\nHost: x\r\nUpgrade: h2c\r\n\r\n",
    "Expect" => "POST / HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\nok",
    "Connection list" => "GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, close\r\n\r\n",
    "Connection: close, then a space" => "GET / HTTP/1.1\r\nHost: x\r\nConnection: close \r\n\r\n",
    "Connection token other than close" => "GET / HTTP/1.1\r\nHost: x\r\nConnection: closed\r\n\r\n",
    "Connection: close and keep-alive" => "GET / HTTP/1.0\r\nConnection: close\r\nConnection: keep-alive\r\n\r\n",
    "Proxy-Connection" => "GET / HTTP/1.1\r\nHost: x\r\nProxy-Connection: close\r\n\r\n",
    "HTTP/2.0" => "GET / HTTP/2.0\r\nHost: x\r\n\r\n",
    "HTTP/1.2" => "GET / HTTP/1.2\r\nHost: x\r\n\r\n",
    "HTTP/2 preface" => "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "HTTP/0.9" => "GET /\r\n\r\n",
    "lowercase method" => "get / HTTP/1.1\r\nHost: x\r\n\r\n",
    "unknown method" => "FOO / HTTP/1.1\r\nHost: x\r\n\r\n",
    "WebDAV method" => "PROPFIND / HTTP/1.1\r\nHost: x\r\n\r\n",
    "two spaces after the method" => "GET  / HTTP/1.1\r\nHost: x\r\n\r\n",
    "a space in the target" => "GET /a b HTTP/1.1\r\nHost: x\r\n\r\n",
    "empty line first" => "\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "incomplete head" => "GET / HTTP/1.1\r\nHost: x\r\n\r",
    "empty header name" => "GET / HTTP/1.1\r\nHost: x\r\n: y\r\n\r\n",
    "header name with a slash" => "GET / HTTP/1.1\r\nHost: x\r\nX/Y: y\r\n\r\n",
    "duplicate header" => "GET / HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nx-a: 2\r\n\r\n",
    "duplicate Cookie" => "GET / HTTP/1.1\r\nHost: x\r\nCookie: a=1\r\nCookie: b=2\r\n\r\n",
    "target over the limit" => "GET /#{'t' * 2048} HTTP/1.1\r\nHost: x\r\n\r\n",
    "header block over the limit" => "GET / HTTP/1.1\r\nHost: x\r\nX: #{'v' * 8192}\r\n\r\n",
    # Whitespace is bytes sent: the block counts it (a fuzz case the fast path took).
    "header block over the limit in leading OWS" => "PUT /:p HTTP/1.1\r\nHost:#{' ' * 8200}x\r\nContent-Length: 0\r\n\r\n",
    "header block one byte over the limit in leading OWS" => "GET / HTTP/1.1\r\nHost: x\r\nX:#{' ' * 8179}v\r\n\r\n",
    # (trailing OWS was counted before: a guard)
    "header block over the limit in trailing OWS" => "GET / HTTP/1.1\r\nHost: x\r\nX: v#{"\t" * 8200}\r\n\r\n",
    "too many headers" => "GET / HTTP/1.1\r\nHost: x\r\n#{Array.new(40) { |i| "X-#{i}: v\r\n" }.join}\r\n"
  }.transform_values(&:b).freeze

  # Plain requests the fast path must take (else it would pass every test
  # above by declining everything).
  TAKEN = {
    "GET" => "GET / HTTP/1.1\r\nHost: localhost:9292\r\nUser-Agent: wrk\r\nAccept: */*\r\n\r\n",
    "query and fragment" => "GET /a/b?c=d&e#f HTTP/1.1\r\nHost: example.com\r\n\r\n",
    "fragment, then ?" => "GET /a#f?g HTTP/1.1\r\nHost: x\r\n\r\n",
    "? only" => "GET /a? HTTP/1.1\r\nHost: x\r\n\r\n",
    "?#" => "GET /a?#f HTTP/1.1\r\nHost: x\r\n\r\n",
    "obs-text" => "GET /caf\xC3\xA9?q=\xFF HTTP/1.1\r\nHost: x\r\nX-Name: caf\xC3\xA9 \xFF\r\n\r\n",
    "HEAD" => "HEAD /h HTTP/1.1\r\nHost: x\r\n\r\n",
    "POST with a body" => "POST /p HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n\r\nhello",
    "CL with a space first" => "POST /p HTTP/1.1\r\nHost: x\r\nContent-Length:  5\r\n\r\nhello",
    "CL 0" => "PUT /p HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
    "CL 05" => "PATCH /p HTTP/1.1\r\nHost: x\r\nContent-Length: 05\r\n\r\nhello",
    "DELETE" => "DELETE /d HTTP/1.1\r\nHost: x\r\n\r\n",
    "OPTIONS" => "OPTIONS /o HTTP/1.1\r\nHost: x\r\n\r\n",
    "HTTP/1.0 keep-alive" => "GET /ten HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n",
    "HTTP/1.0 keep-alive with Host" => "GET /ten HTTP/1.0\r\nHost: x:81\r\nConnection: keep-alive\r\n\r\n",
    "HTTP/1.1 keep-alive" => "GET / HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n",
    # Not kept alive: a proxy's requests (nginx's default to its upstreams), HTTP/1.0's own.
    "Connection: close" => "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    "Connection: CLOSE" => "GET / HTTP/1.1\r\nHost: x\r\nConnection: CLOSE\r\n\r\n",
    "POST with a body, Connection: close" => "POST /p HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 5\r\n\r\nhello",
    "HTTP/1.0" => "GET / HTTP/1.0\r\n\r\n",
    "HTTP/1.0 with Host" => "GET /ten HTTP/1.0\r\nHost: x:81\r\n\r\n",
    "HTTP/1.0 close" => "GET /ten HTTP/1.0\r\nConnection: close\r\n\r\n",
    "Host with a port" => "GET / HTTP/1.1\r\nHost: 10.0.0.1:8080\r\n\r\n",
    "Host with an empty port" => "GET / HTTP/1.1\r\nHost: x:\r\n\r\n",
    "underscore header (dropped)" => "GET / HTTP/1.1\r\nHost: x\r\nX_Forwarded_For: 1.2.3.4\r\nX-Forwarded-For: 5.6.7.8\r\n\r\n",
    "Transfer_Encoding (dropped, not TE)" => "GET / HTTP/1.1\r\nHost: x\r\nTransfer_Encoding: chunked\r\n\r\n",
    "empty and blank values" => "GET / HTTP/1.1\r\nHost: x\r\nX-Empty:\r\nX-Blank: \t \r\nX-Pad: \t a b \t\r\n\r\n",
    "every tchar in a name" => "GET / HTTP/1.1\r\nHost: x\r\n!#$%&'*+-.^`|~09AZaz: v\r\n\r\n",
    "target at the limit" => "GET /#{'t' * 2047} HTTP/1.1\r\nHost: x\r\n\r\n",
    "headers at the limit" => "GET / HTTP/1.1\r\nHost: x\r\n#{Array.new(39) { |i| "X-#{i}: v\r\n" }.join}\r\n",
    # A header block of exactly max_header_bytes (8,192), most of it OWS: one byte more is declined.
    "header block at the limit in leading OWS" => "GET / HTTP/1.1\r\nHost: x\r\nX:#{' ' * 8178}v\r\n\r\n"
  }.transform_values(&:b).freeze

  def setup
    super
    assert defined?(NeverBlock::HTTPHead), "NeverBlock::HTTPHead is not built (run the tests with bin/test, which compiles it)"
  end

  # The fast path alone: nil when it declines `bytes`; else asserts that the
  # llhttp path, fed the same head and a body of the length the fast path
  # read, yields the same env, framing and keep-alive, and returns the env.
  def fast_env(bytes, context = bytes)
    head = NeverBlock::HTTPHead.new(BASE_ENV, "localhost", "8080", LIMITS.max_request_target, LIMITS.max_header_bytes,
                                    LIMITS.max_headers, LIMITS.max_body)
    env = head.parse(bytes, 0) or return nil

    message = "#{bytes.byteslice(0, head.head_end)}#{'b' * head.content_length}"
    llhttp = Parser.new(LIMITS, BASE_ENV, "localhost", "8080", false)
    begin
      llhttp << message
    rescue HTTPError => e
      flunk "the fast path took what llhttp refuses (#{e.status} #{e.message}): #{context.inspect[0, 400]} #{message.inspect[0, 600]}"
    end
    assert_equal 1, llhttp.requests.size, "one request: #{context.inspect[0, 400]}"
    request = llhttp.requests.first
    assert_equal described(request.env), described(env), "env of #{context.inspect[0, 400]}"
    assert request.complete, "llhttp saw the message end where the fast path did: #{context.inspect[0, 400]}"
    assert_equal head.content_length, request.body_bytes, "body length of #{context.inspect[0, 400]}"
    refute llhttp.in_message?, context.inspect[0, 400]
    assert_equal request.keep_alive, head.keep_alive?, "kept alive as llhttp says: #{context.inspect[0, 400]}"
    assert_equal [request.head, request.http10], [head.head?, head.http10?], context.inspect[0, 400]
    env
  end

  # Keys and values with their encodings and frozenness.
  def described(env)
    env.map do |key, value|
      [key, key.encoding, key.frozen?, value, value.is_a?(String) ? [value.encoding, value.frozen?] : nil]
    end.sort_by { |key, *| key }
  end

  # What a Parser makes of `pieces` (successive reads).
  def outcome(pieces, head_parser)
    parser = Parser.new(LIMITS, BASE_ENV, "localhost", "8080", head_parser)
    error = nil
    pieces.each do |piece|
      parser << piece
    rescue HTTPError => e
      error = [e.status, e.message]
      break
    end
    requests = parser.requests.map do |request|
      [described(request.env), request.body, request.body_bytes, request.complete, request.keep_alive,
       request.expects_continue, request.head, request.http10]
    end
    [requests, error, parser.in_message?, parser.in_body?]
  end

  def assert_same_parse(pieces, context)
    assert_equal outcome(pieces, false), outcome(pieces, true), "#{context}: #{pieces.inspect[0, 600]}"
  end

  # `bytes` in 1-4 reads split at random.
  def random_pieces(bytes, random)
    cuts = Array.new(random.rand(0..3)) { random.rand(0..bytes.bytesize) }.sort
    [0, *cuts, bytes.bytesize].each_cons(2).map { |from, to| bytes.byteslice(from, to - from) }
  end

  def test_declines_the_shapes_llhttp_refuses_or_treats_otherwise
    DECLINED.each do |name, bytes|
      assert_nil fast_env(bytes), "#{name} was taken by the fast path"
      assert_same_parse([bytes], name)
      assert_same_parse(["GET /before HTTP/1.1\r\nHost: x\r\n\r\n".b, bytes], "#{name} after a request")
    end
  end

  def test_takes_plain_requests_with_the_env_llhttp_gives
    TAKEN.each do |name, bytes|
      assert fast_env(bytes, name), "#{name} was declined"
      assert_same_parse([bytes], name)
    end
    env = fast_env(TAKEN.fetch("query and fragment"))
    assert_equal ["GET", "/a/b", "c=d&e", "example.com", "80", "HTTP/1.1"],
                 env.values_at("REQUEST_METHOD", "PATH_INFO", "QUERY_STRING", "SERVER_NAME", "SERVER_PORT", "SERVER_PROTOCOL")
    assert_equal :early_hints, env["rack.early_hints"]
    env = fast_env(TAKEN.fetch("HTTP/1.0 keep-alive"))
    assert_equal ["localhost", "8080", "HTTP/1.0"], env.values_at("SERVER_NAME", "SERVER_PORT", "SERVER_PROTOCOL")
    refute env.key?("rack.early_hints"), "1xx responses are HTTP/1.1's"
    env = fast_env(TAKEN.fetch("underscore header (dropped)"))
    assert_equal "5.6.7.8", env["HTTP_X_FORWARDED_FOR"]
  end

  def test_tells_which_requests_are_kept_alive
    head = NeverBlock::HTTPHead.new(BASE_ENV, "localhost", "8080", 2048, 8192, 40, 65_536)
    kept = TAKEN.select { |_name, bytes| head.parse(bytes, 0) && head.keep_alive? }.keys
    assert_includes kept, "GET"
    assert_includes kept, "HTTP/1.0 keep-alive"
    assert_includes kept, "HTTP/1.1 keep-alive"
    closing = ["Connection: close", "Connection: CLOSE", "POST with a body, Connection: close", "HTTP/1.0",
               "HTTP/1.0 with Host", "HTTP/1.0 close"]
    assert_empty kept & closing
    assert_equal closing.size, closing.count { |name| head.parse(TAKEN.fetch(name), 0) }
  end

  # REQUEST_METHOD is one frozen String per method on both paths (binary,
  # as llhttp names it), not one allocated per request.
  def test_request_method_is_one_frozen_string_per_method
    %w[GET HEAD POST PUT DELETE OPTIONS PATCH].each do |name|
      bytes = "#{name} / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".b
      fast = Array.new(2) { fast_env(bytes).fetch("REQUEST_METHOD") }
      llhttp = Parser.new(LIMITS, BASE_ENV, "localhost", "8080", false)
      2.times { llhttp << bytes }
      slow = llhttp.requests.map { |request| request.env.fetch("REQUEST_METHOD") }
      [fast, slow].each do |first, second|
        assert_equal name, first
        assert first.frozen?, "#{name} is frozen"
        assert_equal Encoding::BINARY, first.encoding
        assert_same first, second, "#{name}: one String for every request"
      end
      assert_same fast.first, slow.first, "#{name}: the same String on both paths"
    end
  end

  # Every byte in every place of a request: the fast path takes only what
  # llhttp takes with the same meaning.
  def test_every_byte_in_every_place
    taken = 0
    templates = [
      "%sGET / HTTP/1.1\r\nHost: x\r\n\r\n", "GE%sT / HTTP/1.1\r\nHost: x\r\n\r\n", "GET%s/ HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /a%sb HTTP/1.1\r\nHost: x\r\n\r\n", "GET /a?q%sr#f HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /a?q#f%sg HTTP/1.1\r\nHost: x\r\n\r\n", "GET /%s HTTP/1.1\r\nHost: x\r\n\r\n",
      "GET /%sHTTP/1.1\r\nHost: x\r\n\r\n", "GET / HTTP/1.%s\r\nHost: x\r\n\r\n", "GET / HTTP/1.1%s\r\nHost: x\r\n\r\n",
      "GET / HTTP/1.1\r%sHost: x\r\n\r\n", "GET / HTTP/1.1\r\n%sHost: x\r\n\r\n", "GET / HTTP/1.1\r\nHo%sst: x\r\n\r\n",
      "GET / HTTP/1.1\r\nHost%s: x\r\n\r\n", "GET / HTTP/1.1\r\nHost:%sx\r\n\r\n", "GET / HTTP/1.1\r\nHost: x%s\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x:8%s\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\nX-A: %s\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nX-A: a%sb\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a%s\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nX%sA: a\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r%s\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nX-A: a\r\n%s\r\n", "GET / HTTP/1.1\r\nHost: x\r\n\r%s",
      "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %s5\r\n\r\n12345",
      "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5%s\r\n\r\n12345",
      "POST / HTTP/1.1\r\nHost: x\r\nContent-Length:%s5\r\n\r\n12345",
      "GET / HTTP/1.0\r\nConnection: keep-alive%s\r\n\r\n", "GET / HTTP/1.0\r\nConnection: %skeep-alive\r\n\r\n",
      "GET / HTTP/1.1\r\nHost: x\r\nConnection%s: close\r\n\r\n", "GET / HTTP/1.1\r\nHost: x\r\n\r\n%s"
    ]
    templates.each do |template|
      256.times do |byte|
        bytes = format(template.b, byte.chr.b)
        taken += 1 if fast_env(bytes)
        assert_same_parse([bytes], "byte #{byte} in #{template.inspect}")
      end
    end
    assert_operator taken, :>, 2_000, "the fast path took the plain ones"
  end

  # The fuzz generator's valid, mutated, random, chunked and oversized
  # cases, whole and in random reads.
  def test_fuzz_cases_parse_as_llhttp_parses_them
    puts "\n#{self.class}: NEVERBLOCK_FUZZ_SEED=#{SEED} (#{FUZZ_CASES} cases)"
    random = Random.new(SEED)
    taken = Hash.new(0)
    FUZZ_CASES.times do
      bytes, _expected, kind = fuzz_case(random)
      bytes = bytes.b
      taken[kind] += 1 if fast_env(bytes, "#{kind} case (NEVERBLOCK_FUZZ_SEED=#{SEED})")
      assert_same_parse([bytes], "#{kind} case, whole (NEVERBLOCK_FUZZ_SEED=#{SEED})")
      assert_same_parse(random_pieces(bytes, random), "#{kind} case in pieces (NEVERBLOCK_FUZZ_SEED=#{SEED})")
    end
    assert_operator taken[:valid], :>, FUZZ_CASES / 20, "the fast path took valid requests (#{taken})"
  end

  # A pipeline of plain requests, with bodies, split at every byte: the
  # fast path hands over to llhttp and back at each boundary, and reads
  # bodies that span reads.
  def test_pipelines_at_every_split
    pipeline = [TAKEN.fetch("POST with a body"), DECLINED.fetch("TE chunked"), TAKEN.fetch("GET"),
                TAKEN.fetch("CL 05"), "GET /last HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".b,
                TAKEN.fetch("GET")].join
    (1...pipeline.bytesize).each do |at|
      assert_same_parse([pipeline.byteslice(0, at), pipeline.byteslice(at, pipeline.bytesize)], "split at #{at}")
    end
    random = Random.new(SEED)
    200.times { assert_same_parse(random_pieces(pipeline, random), "random split (NEVERBLOCK_FUZZ_SEED=#{SEED})") }
  end

  def test_a_body_read_in_pieces_completes_the_request
    parser = Parser.new(LIMITS, BASE_ENV, "localhost", "8080", true)
    parser << "POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n0123".b
    assert parser.in_body?
    refute parser.requests.first.complete
    parser << "456".b
    assert parser.in_message?
    parser << "789GET /next HTTP/1.1\r\nHost: x\r\n\r\n".b
    refute parser.in_message?
    assert_equal ["0123456789", ""], [parser.requests.first.body, parser.requests.last.env["QUERY_STRING"]]
    assert_equal [true, true], parser.requests.map(&:complete)
  end

  # After a request llhttp ends the connection with, llhttp refuses what
  # follows: the fast path must not take it either.
  def test_no_fast_path_after_a_request_not_kept_alive
    closing = "GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".b
    assert_same_parse([closing, TAKEN.fetch("GET")], "after Connection: close")
    assert_same_parse([TAKEN.fetch("HTTP/1.0"), TAKEN.fetch("GET")], "after HTTP/1.0")
    assert_same_parse([closing + TAKEN.fetch("GET")], "after Connection: close, in the same read")
    body = TAKEN.fetch("POST with a body, Connection: close")
    assert_same_parse([body + TAKEN.fetch("GET")], "after a body and Connection: close")
    assert_same_parse([body[0, body.bytesize - 2], body[-2, 2] + TAKEN.fetch("GET")], "after a body in two reads")
    parser = Parser.new(LIMITS, BASE_ENV, "localhost", "8080", true)
    parser << closing + TAKEN.fetch("GET")
    assert_equal [false], parser.requests.map(&:keep_alive), "the request after one not kept alive is not read"
  end

  def test_the_switch_turns_the_fast_path_off
    switch = ENV.fetch(Parser::HEAD_PARSER_SWITCH, nil)
    ENV[Parser::HEAD_PARSER_SWITCH] = "off"
    refute Parser.head_parser?
    ENV[Parser::HEAD_PARSER_SWITCH] = nil
    assert Parser.head_parser?
  ensure
    ENV[Parser::HEAD_PARSER_SWITCH] = switch
  end

  # A head without header lines (HTTP/1.0's) is under any limit but one below
  # zero: nothing is (the fuzzer's limits include negative ones).
  def test_a_head_without_headers_is_declined_under_a_negative_limit
    bytes = "GET /ten HTTP/1.0\r\n\r\n".b
    assert NeverBlock::HTTPHead.new(BASE_ENV, "localhost", "8080", 100, 0, 0, 100).parse(bytes, 0)
    assert_nil NeverBlock::HTTPHead.new(BASE_ENV, "localhost", "8080", 100, 100, -1, 100).parse(bytes, 0)
    assert_nil NeverBlock::HTTPHead.new(BASE_ENV, "localhost", "8080", 100, -1, 100, 100).parse(bytes, 0)
  end

  def test_parse_refuses_an_offset_outside_the_data
    head = NeverBlock::HTTPHead.new(BASE_ENV, "localhost", "8080", 10, 10, 10, 10)
    assert_raises(ArgumentError) { head.parse("GET".b, 4) }
    assert_raises(ArgumentError) { head.parse("GET".b, -1) }
    assert_nil head.parse("GET".b, 3)
  end

  # HTTPHead is write-barrier protected (so an old one, a long-lived
  # connection's, is not marked again on every minor GC): every VALUE it
  # stores after allocation must go through RB_OBJ_WRITE, or a minor GC may
  # free the young String under it (its Host cache holds interned Strings,
  # which the fstring table holds weakly). Ruby's own check finds a missed
  # barrier (an old object pointing at a young one it never remembered)
  # and aborts, hence a child process.
  def test_an_old_head_stores_through_write_barriers
    out, err, status = run_ruby(<<~'RUBY')
      require "neverblock/server"
      head = NeverBlock::HTTPHead.new({}, "localhost", "8080", 2048, 8192, 40, 65_536)
      host = "fresh-#{rand(10**12)}.example"
      # The name and port interned and old beforehand: only the whole Host
      # is a new String, so one missed barrier is not hidden by another store.
      kept = [-host.b, -"8443".b]
      4.times { GC.start } # head and kept are old now
      request = "GET / HTTP/1.1\r\nHost: #{host}:8443\r\n\r\n".b
      env = head.parse(request, 0)
      GC.verify_internal_consistency
      GC.start # (a major GC forgets what the parse's stores remembered)
      head.send(:initialize, { "a" => "b" }, +"h#{rand(10)}", +"8#{rand(10)}", 2048, 8192, 40, 65_536)
      GC.verify_internal_consistency
      3.times { GC.start(full_mark: false, immediate_sweep: true) }
      again = head.parse(request, 0)
      puts [env["SERVER_NAME"] == host, again["SERVER_NAME"] == host, again["SERVER_PORT"]].inspect
      kept.clear
    RUBY
    assert status.success?, "the child failed:\n#{err[0, 2000]}"
    assert_equal "[true, true, \"8443\"]", out.strip
  end
end
