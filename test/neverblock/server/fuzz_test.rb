# frozen_string_literal: true

require_relative "server_helper"
require_relative "fuzz_cases"

# Throws random bytes and mutated requests at a server from many concurrent
# connections, and checks that it never crashes, hangs or leaks, answers
# garbage with 4xx or a close, and keeps answering valid requests correctly.
#
# Reproduce a run with its printed seed: NEVERBLOCK_FUZZ_SEED=1234.
# More cases: NEVERBLOCK_FUZZ_BATCHES=100 (250 cases each).
class ServerFuzzTest < PlainTest
  include ServerHelper
  include FuzzCases

  SEED = Integer(ENV.fetch("NEVERBLOCK_FUZZ_SEED", Random.new_seed % 1_000_000_000))
  BATCHES = Integer(ENV.fetch("NEVERBLOCK_FUZZ_BATCHES", 12))
  BATCH_SIZE = 250
  CLIENTS = 24

  # Every connection must end within this (the fuzz server's timeouts are
  # 1 s, a refused request lingers 1 s): far more means a hang.
  CASE_DEADLINE = 8

  # What the fuzz server may answer. 409: a hijack refused because more
  # bytes were pipelined; 101 or 426: /ws with or without Upgrade. Anything else (a 500 above
  # all) fails the test.
  ALLOWED = [100, 101, 200, 400, 408, 409, 413, 414, 426, 431, 505].freeze

  LIMITS = { header_timeout: 1, body_timeout: 1, idle_timeout: 1, write_timeout: 2, shutdown_timeout: 2,
             max_body: 64 * 1024, max_header_bytes: 8 * 1024, max_request_target: 2048, max_headers: 40 }.freeze

  APP = lambda do |env|
    body = env["rack.input"].read
    case env["PATH_INFO"]
    when "/ws"
      return [426, { "content-length" => "0" }, []] unless env["HTTP_UPGRADE"]

      begin
        io = env["rack.hijack"].call
      rescue NeverBlock::Error
        return [409, { "content-length" => "0" }, []]
      end
      io.write("HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n")
      io.close
      [200, {}, []]
    when "/stream"
      [200, { "content-type" => "text/plain" }, ["s1:", body.bytesize.to_s].each]
    when "/call"
      [200, { "content-type" => "text/plain" }, ->(stream) { stream.write("c:#{body.bytesize}"); stream.close }]
    else
      text = "#{env['REQUEST_METHOD']} #{env['PATH_INFO']} #{body.bytesize}"
      [200, { "content-type" => "text/plain", "content-length" => text.bytesize.to_s },
       env["REQUEST_METHOD"] == "HEAD" ? [] : [text]]
    end
  end

  # Sends one case on a new connection in random pieces; returns what came
  # back and how the connection ended (:eof, :reset, :timeout, :abandoned).
  def run_case(bytes, random)
    socket = TCPSocket.new("127.0.0.1", @port)
    abandon = random.rand(12).zero? ? random.rand(0..bytes.bytesize) : nil
    to_send = abandon ? bytes.byteslice(0, abandon) : bytes
    deadline = now + CASE_DEADLINE
    begin
      until to_send.empty?
        piece = to_send.byteslice(0, random.rand(4).zero? ? random.rand(1..32) : to_send.bytesize)
        to_send = to_send.byteslice(piece.bytesize, to_send.bytesize)
        write_all(socket, piece, deadline)
        sleep(0.001) if random.rand(20).zero?
      end
    rescue Errno::EPIPE, Errno::ECONNRESET
      nil # refused and closed before all was sent: what it answered is still checked
    end
    if abandon
      socket.setsockopt(Socket::SOL_SOCKET, Socket::SO_LINGER, [1, 0].pack("ii")) if random.rand(2).zero? # a reset
      return ["", :abandoned]
    end

    socket.close_write unless random.rand(8).zero? # else the server's timeouts must end it
    drain(socket, deadline)
  ensure
    socket&.close
  end

  def write_all(socket, data, deadline)
    until data.empty?
      written = socket.write_nonblock(data, exception: false)
      if written == :wait_writable
        raise Errno::EPIPE unless socket.wait_writable([deadline - now, 0].max) # the server stopped reading
      else
        data = data.byteslice(written, data.bytesize)
      end
    end
  end

  def drain(socket, deadline)
    data = +""
    loop do
      remaining = deadline - now
      return [data, :timeout] unless remaining.positive? && socket.wait_readable(remaining)

      chunk = socket.read_nonblock(65_536, exception: false)
      return [data, :eof] if chunk.nil?

      data << chunk unless chunk == :wait_readable
    end
  rescue Errno::ECONNRESET
    [data, :reset]
  end

  # Splits raw responses into [status, body] pairs (101 ends the stream;
  # bodies framed by Content-Length, chunks or the close).
  def parse_responses(data, head_flags)
    io = StringIO.new(data)
    responses = []
    until io.eof?
      line = io.gets("\r\n") or break
      status = Integer(line[%r{\AHTTP/1\.1 (\d{3}) }, 1] || raise("not a status line: #{line.inspect}"))
      headers = {}
      while (header = io.gets("\r\n")) && header != "\r\n"
        key, value = header.chomp("\r\n").split(": ", 2)
        headers[key] = value
      end
      next if status == 100

      head = head_flags.shift
      body = if head || status == 101 || status == 204 || status == 304 then nil
             elsif headers["transfer-encoding"] == "chunked"
               text = +""
               while (size = Integer(io.gets("\r\n").chomp("\r\n"), 16)).positive?
                 text << io.read(size)
                 io.read(2)
               end
               io.read(2)
               text
             elsif headers["content-length"] then io.read(Integer(headers["content-length"]))
             else io.read
             end
      responses << [status, body]
      break if status == 101
    end
    responses
  end

  def check_case(bytes, expected, kind, data, ending)
    context = "#{kind} case #{bytes.inspect[0, 300]} got #{data.inspect[0, 300]} (#{ending})"
    refute_equal :timeout, ending, "hung: #{context}"
    return if ending == :abandoned

    unless data.empty?
      assert data.start_with?("HTTP/1.1 "), "not a response: #{context}"
      statuses = data.scan(%r{(?:\A|\n)HTTP/1\.1 (\d{3}) }).flatten.map(&:to_i)
      assert_empty statuses - ALLOWED, "unexpected status: #{context}"
      if %i[random oversized].include?(kind)
        assert statuses.all? { |status| status >= 400 }, "garbage was served: #{context}"
      end
    end
    return unless expected

    heads = expected.map { |status, body| status == 200 && body.nil? }
    actual = parse_responses(data, heads)
    assert_equal expected.map { |status, body| [status, body&.b] }, actual.map { |status, body| [status, body&.b] },
                 "wrong answers: #{context}"
  end

  def assert_serves_a_valid_request
    socket = connect
    socket.write(get("/check?x=1"))
    assert_equal [200, "GET /check 0"], read_response(socket, timeout: 5).values_at(0, 2)
    socket.close
    @sockets.delete(socket)
  end

  def test_random_and_mutated_requests_never_break_the_server
    puts "\n#{self.class}: NEVERBLOCK_FUZZ_SEED=#{SEED} (#{BATCHES} batches of #{BATCH_SIZE})"
    random = Random.new(SEED)
    GC.start # sockets earlier tests dropped without closing
    fds = fd_count
    errors = StringIO.new
    stderr = $stderr
    counts = Hash.new(0)
    stall_threshold = NeverBlock.stall_threshold
    # The clients are threads of this process: while they hold the GVL the
    # server's loop cannot run, which the stall detector would report.
    NeverBlock.stall_threshold = nil
    log = capture_log do
      $stderr = errors
      start_server(APP, **LIMITS)
      BATCHES.times do
        cases = Array.new(BATCH_SIZE) do
          bytes, expected, kind = fuzz_case(random)
          [bytes, expected, kind, random.rand(1 << 30)]
        end
        queue = Thread::Queue.new(cases)
        queue.close
        results = Thread::Queue.new
        Array.new(CLIENTS) do
          Thread.new do
            while (bytes, expected, kind, case_seed = queue.pop)
              results << [bytes, expected, kind, *run_case(bytes, Random.new(case_seed))]
            end
          end
        end.each(&:join)
        results.close
        while (result = results.pop)
          counts[result[2]] += 1
          check_case(*result)
        end
        assert @server_thread.alive?, "the server thread died"
        assert_serves_a_valid_request
      end
      eventually { @server.stats[:connections].zero? && @server.stats[:requests_in_flight].zero? }
    ensure
      $stderr = stderr
      NeverBlock.stall_threshold = stall_threshold
    end
    assert @server_thread.alive?, "the server thread died"
    # Refusals are logged, at most one line a second for each status, and so
    # are clients that hang up during a streamed response (a line, then a
    # summary a second).
    expected = /NeverBlock::Server: (refused a request from|.*: the client hung up |\d+ more requests? (was|were) cancelled )/
    assert_empty log.lines.grep_v(expected).join,
                 "the server logged (an app error or Rack::Lint failure?)"
    assert_empty errors.string, "something wrote to $stderr (a thread's unhandled exception?)"
    @server.stop
    assert @server_thread.join(20), "server did not stop"
    @server = nil
    # No more than before (earlier tests' descriptors may still close meanwhile, so not "equal").
    assert_operator fd_count, :<=, fds, "file descriptors leaked"
    assert_equal BATCHES * BATCH_SIZE, counts.values.sum, "every case ran and was checked"
  end
end
