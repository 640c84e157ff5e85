# frozen_string_literal: true

# The fuzz generator's cases, shared by the fuzz test (which throws them at
# a server) and the head parser's differential test (which feeds them to the
# C fast path and to llhttp and compares): valid pipelines with the answers
# ServerFuzzTest::APP gives them, their mutations, random bytes, lying
# chunked bodies, requests over ServerFuzzTest::LIMITS.
module FuzzCases
  # Valid requests and what the app answers them (status, body); nil body:
  # not checked (HEAD, 101).
  def valid_request(random)
    body = random.bytes(random.rand(0..300)).b
    case random.rand(10)
    when 0 then ["GET /get?q=#{random.rand(1000)} HTTP/1.1\r\nHost: fuzz\r\nX-A: #{'a' * random.rand(50)}\r\n\r\n", [200, "GET /get 0"]]
    when 1 then ["POST /post HTTP/1.1\r\nHost: fuzz\r\nContent-Length: #{body.bytesize}\r\n\r\n#{body}", [200, "POST /post #{body.bytesize}"]]
    when 2
      chunks = body.empty? ? "" : "#{body.bytesize.to_s(16)};ext=1\r\n#{body}\r\n"
      ["PUT /chunked HTTP/1.1\r\nHost: fuzz\r\nTransfer-Encoding: chunked\r\n\r\n#{chunks}0\r\nX-Trailer: t\r\n\r\n",
       [200, "PUT /chunked #{body.bytesize}"]]
    when 3 then ["HEAD /head HTTP/1.1\r\nHost: fuzz\r\n\r\n", [200, nil]]
    when 4 then ["POST /stream HTTP/1.1\r\nHost: fuzz\r\nContent-Length: #{body.bytesize}\r\n\r\n#{body}", [200, "s1:#{body.bytesize}"]]
    when 5 then ["GET /call HTTP/1.1\r\nHost: fuzz\r\n\r\n", [200, "c:0"]]
    when 6
      ["POST /expect HTTP/1.1\r\nHost: fuzz\r\nExpect: 100-continue\r\nContent-Length: #{body.bytesize}\r\n\r\n#{body}",
       [200, "POST /expect #{body.bytesize}"]]
    when 7 then ["GET http://fuzz/absolute HTTP/1.1\r\nHost: fuzz\r\n\r\n", [200, "GET /absolute 0"]]
    when 8 then ["OPTIONS * HTTP/1.1\r\nHost: fuzz\r\n\r\n", [200, "OPTIONS * 0"]]
    else ["DELETE /d HTTP/1.1\r\nhost: fuzz\r\ncookie: a=1\r\ncookie: b=2\r\n\r\n", [200, "DELETE /d 0"]]
    end
  end

  # Requests that end the connection: only last in a pipeline.
  def last_request(random)
    case random.rand(3)
    when 0 then ["GET /last HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n\r\n", [200, "GET /last 0"]]
    when 1 then ["GET /ten HTTP/1.0\r\n\r\n", [200, "GET /ten 0"]]
    else ["GET /ws HTTP/1.1\r\nHost: fuzz\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n", [101, nil]]
    end
  end

  # An Upgrade ends a pipeline only after requests without a body: after a
  # body that spans reads (run_case sends in random pieces) the server
  # refuses it with 400, the known limit README names (the llhttp gem cannot
  # say where the upgrade request ended); hijack_test covers that refusal.
  def valid_pipeline(random)
    requests = Array.new(random.rand(1..4)) { valid_request(random) }
    if random.rand(3).zero?
      last = last_request(random)
      requests << last unless last.last.first == 101 && requests.any? { |request, _| body?(request) }
    end
    [requests.map(&:first).join, requests.map(&:last)]
  end

  def body?(request)
    request.match?(/^(?:Content-Length|Transfer-Encoding): /)
  end

  SPECIAL = ["\r", "\n", "\r\n", "\0", " ", ":", "\t", "0", "ffffffffffffffffff", "-1", "\xff".b, "%", "?", "#",
             "Transfer-Encoding: chunked\r\n", "Content-Length: 5\r\n", "Content-Length: 99999999999999999999\r\n",
             "Connection: Upgrade\r\nUpgrade: x\r\n", "Expect: 100-continue\r\n", "Host: \r\n", "\r\n\r\n"].map(&:b).freeze

  def mutate(data, random)
    data = data.b
    random.rand(1..3).times do
      position = data.empty? ? 0 : random.rand(data.bytesize)
      case random.rand(8)
      when 0 # bit flip
        next if data.empty?

        data.setbyte(position, data.getbyte(position) ^ (1 << random.rand(8)))
      when 1 then data = data.byteslice(0, position) # truncation
      when 2 then data.insert(position, data.byteslice(position, random.rand(1..64)) || "") # duplication
      when 3 then data = data.byteslice(0, position) + (data.byteslice(position + random.rand(1..32), data.bytesize) || "")
      when 4 then data.insert(position, random.bytes(random.rand(1..16)))
      when 5 then data.insert(position, SPECIAL.sample(random: random))
      when 6 then data.insert(position, "X-Huge: #{'h' * random.rand(1000..20_000)}\r\n") # huge header
      else data.insert(position, "#{random.rand(2).zero? ? 'zz' : random.rand(1 << 20).to_s(16)}\r\n#{random.bytes(random.rand(20))}\r\n")
      end
    end
    data
  end

  CHUNK_SIZES = ["zz", "ffffffffffffffffff", "-1", "5 ", " 5", "0x5", "5;#{'e' * 70_000}", "", "1" * 30, "5\n"].freeze

  # A chunked body that lies: bad sizes, sizes that do not match the data,
  # missing CRLFs, oversized extensions, endless trailers.
  def bogus_chunked(random)
    chunks = Array.new(random.rand(1..4)) do
      data = random.bytes(random.rand(0..40))
      size = random.rand(3).zero? ? CHUNK_SIZES.sample(random: random) : (data.bytesize + random.rand(-3..3)).abs.to_s(16)
      "#{size}\r\n#{data}#{random.rand(4).zero? ? '' : "\r\n"}"
    end
    ending = ["0\r\n\r\n", "0\r\n", "", "0\r\n#{"X-T: t\r\n" * random.rand(50..200)}\r\n"].sample(random: random)
    "POST /chunked HTTP/1.1\r\nHost: fuzz\r\nTransfer-Encoding: chunked\r\n\r\n#{chunks.join}#{ending}".b
  end

  # Requests over a limit (see LIMITS): target, header block, header count, body.
  def oversized(random)
    case random.rand(4)
    when 0 then "GET /#{'u' * random.rand(2_100..10_000)} HTTP/1.1\r\nHost: fuzz\r\n\r\n"
    when 1 then "GET / HTTP/1.1\r\nHost: fuzz\r\nX-Big: #{'b' * random.rand(8_200..100_000)}\r\n\r\n"
    when 2 then "GET / HTTP/1.1\r\nHost: fuzz\r\n#{Array.new(random.rand(40..200)) { |i| "X-#{i}: v\r\n" }.join}\r\n"
    else "POST / HTTP/1.1\r\nHost: fuzz\r\nContent-Length: #{random.rand(65_537..200_000)}\r\n\r\n#{'x' * random.rand(0..100_000)}"
    end.b
  end

  # One case: [bytes, expected responses or nil, kind].
  def fuzz_case(random)
    case random.rand(12)
    when 0, 1 then [random.bytes(random.rand(1..2000)), nil, :random]
    when 2, 3 then [*valid_pipeline(random), :valid]
    when 4 then [bogus_chunked(random), nil, :chunked]
    when 5 then [oversized(random), nil, :oversized]
    else [mutate(valid_pipeline(random).first, random), nil, :mutated]
    end
  end
end
