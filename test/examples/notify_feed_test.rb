# frozen_string_literal: true

require_relative "../test_helper"
require "json"
require "net/http"
require "pg"
require "securerandom"
require "timeout"

# examples/notify_feed/config.ru as a user runs it: `neverblock serve` in a
# child process against bin/test's PostgreSQL, with server-sent-event
# clients on raw sockets.
class NotifyFeedExampleTest < PlainTest
  include NeverBlockTest::Databases

  EXE = File.expand_path("../../exe/neverblock", __dir__)
  CONFIG_RU = File.expand_path("../../examples/notify_feed/config.ru", __dir__)

  # One GET /events stream read from a raw socket: the chunked body is
  # decoded and split into events as the bytes arrive.
  class EventClient
    Event = Struct.new(:event, :data, :comment, keyword_init: true)

    attr_reader :status, :headers

    # @return [Integer] the pid of the worker serving it (from its `ready` event).
    attr_accessor :worker

    def initialize(port, rcvbuf: nil)
      @socket = Socket.new(:INET, :STREAM)
      @socket.setsockopt(Socket::SOL_SOCKET, Socket::SO_RCVBUF, rcvbuf) if rcvbuf
      @socket.connect(Socket.sockaddr_in(port, "127.0.0.1"))
      @socket.write("GET /events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
      @raw = "".b   # bytes not yet de-chunked
      @text = "".b  # event-stream text not yet split into events
      @ended = false
    end

    # Reads the status line and headers.
    # @return [self]
    def read_head(timeout: 10)
      deadline = now + timeout
      fill(deadline) until @raw.include?("\r\n\r\n")
      head, @raw = @raw.split("\r\n\r\n", 2)
      status_line, *lines = head.split("\r\n")
      @status = Integer(status_line[/\AHTTP\/1\.1 (\d{3})/, 1])
      @headers = lines.to_h { |line| line.split(": ", 2).then { |key, value| [key.downcase, value] } }
      dechunk # the body's first bytes may have come with the head
      self
    end

    # @return [Event, nil] the next event or comment; nil when the response ended.
    def next_event(timeout: 10)
      deadline = now + timeout
      loop do
        if (index = @text.index("\n\n"))
          return parse(@text.slice!(0, index + 2))
        end
        return nil if @ended

        fill(deadline)
      end
    end

    # @return [Array<String>] the data of the next `count` messages (heartbeats skipped).
    def messages(count, timeout: 10)
      Array.new(count) do
        loop do
          event = next_event(timeout: timeout) or raise "the stream ended"
          break event.data if event.event.nil? && event.data
        end
      end
    end

    def close
      @socket.close unless @socket.closed?
    end

    private

    def fill(deadline)
      remaining = deadline - now
      unless remaining.positive? && @socket.wait_readable(remaining)
        raise Timeout::Error, "nothing within the time; so far: #{@text.inspect[0, 200]}"
      end

      chunk = @socket.read_nonblock(65_536, exception: false)
      raise EOFError, "the server closed the connection" if chunk.nil?
      return if chunk == :wait_readable

      @raw << chunk
      dechunk if @status
    end

    def dechunk
      while (line_end = @raw.index("\r\n"))
        size = Integer(@raw[0, line_end], 16)
        break if @raw.bytesize < line_end + 2 + size + 2

        @ended = true if size.zero?
        @text << @raw.byteslice(line_end + 2, size)
        @raw = @raw.byteslice(line_end + 2 + size + 2..)
      end
    end

    def parse(block)
      fields = { event: nil, data: nil, comment: nil }
      block.force_encoding(Encoding::UTF_8).split("\n").each do |line|
        if line.start_with?(":")
          fields[:comment] = line.delete_prefix(":").strip
        else
          key, value = line.split(": ", 2)
          fields[:data] = fields[:data] ? "#{fields[:data]}\n#{value}" : value.to_s if key == "data"
          fields[:event] = value if key == "event"
        end
      end
      Event.new(**fields)
    end

    def now
      NeverBlock::Clock.now
    end
  end

  def setup
    @channel = "feed_test_#{SecureRandom.hex(4)}"
    @clients = []
  end

  def teardown
    @clients.each(&:close)
    if @pid
      begin
        Process.kill("KILL", -@pid)
      rescue Errno::ESRCH
        nil
      end
      Process.wait(@pid)
      @reader&.join(5)
      @out.close
    end
    super
  end

  def test_every_client_gets_every_message_in_order_from_post_and_from_psql
    serve(workers: 2)
    clients = Array.new(20) { subscribe }
    workers = clients.map(&:worker).uniq

    messages = ["one", "two\nlines", "three", "quatre é ✓", "five", "six"]
    with_pg do |conn|
      messages.each_with_index do |message, index|
        if index.even?
          response = publish(message)
          assert_equal "202", response.code, response.body
        else
          conn.exec("NOTIFY #{conn.quote_ident(@channel)}, #{conn.escape_literal(message)}")
        end
      end
      assert_equal workers.size, listener_connections(conn), "one LISTEN connection per worker with clients, " \
                                                             "not one per client"
    end

    clients.each_with_index do |client, index|
      assert_equal messages, client.messages(messages.size), "client #{index} (worker #{client.worker})"
    end
  end

  def test_a_client_that_leaves_is_removed_and_the_last_one_stops_the_listener
    serve(workers: 0, heartbeat: 0.2)
    leaving = subscribe
    staying = subscribe
    assert_equal({ "clients" => 2, "listening" => true }, stats.slice("clients", "listening"))

    leaving.close
    eventually { stats["clients"] == 1 } # found at a heartbeat: writing to the closed connection fails
    publish("still here")
    assert_equal ["still here"], staying.messages(1)
    assert_equal 1, stats["delivered"], "queued for the remaining client only"

    staying.close
    eventually { stats["clients"].zero? }
    assert_equal false, stats["listening"]
    with_pg do |conn|
      eventually { listener_connections(conn).zero? }
    end
  end

  def test_an_idle_stream_gets_heartbeats
    serve(workers: 0, heartbeat: 0.2)
    client = subscribe
    assert_equal "heartbeat", client.next_event(timeout: 5).comment
    assert_equal "heartbeat", client.next_event(timeout: 5).comment
  end

  def test_payloads_up_to_7999_bytes_go_through_and_larger_ones_get_413
    serve(workers: 0)
    client = subscribe

    response = publish("x" * 8000)
    assert_equal "413", response.code
    assert_match(/at most 7999 bytes/, response.body)
    chunked = raw_request("POST /publish HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n" \
                          "1f40\r\n#{'x' * 8000}\r\n0\r\n\r\n")
    assert_match(/\AHTTP\/1\.1 413 /, chunked, "a body without Content-Length is bounded too")
    assert_equal "400", publish("bad \xFF bytes".b).code

    assert_equal "202", publish("y" * 7999).code
    assert_equal "202", publish("").code
    assert_equal ["y" * 7999, ""], client.messages(2), "the largest payload and an empty one go through"
    assert_equal 2, stats["delivered"]
  end

  def test_a_burst_longer_than_the_queue_limit_reaches_a_client_that_keeps_up
    serve(workers: 0, queue_limit: 50)
    client = subscribe
    with_pg do |conn| # 200 notifications in one transaction reach the listener back to back
      conn.exec_params("SELECT pg_notify($1, 'burst ' || n) FROM generate_series(1, 200) n", [@channel])
    end
    assert_equal (1..200).map { |n| "burst #{n}" }, client.messages(200)
    assert_equal({ "clients" => 1, "dropped" => 0 }, stats.slice("clients", "dropped"))
  end

  def test_a_client_that_stops_reading_is_dropped_and_the_others_get_everything
    serve(workers: 0, queue_limit: 50)
    slow = subscribe(rcvbuf: 4096) # and never read until it is dropped
    fast = subscribe
    expected = []
    with_pg do |conn|
      until stats["dropped"].positive?
        flunk "the slow client was not dropped after #{expected.size} messages of 7 KB" if expected.size >= 20_000
        # 20 notifications in one transaction (a burst), padded to 7000 bytes
        first = expected.size + 1
        burst = (first...first + 20).map { |n| n.to_s.rjust(7000, ".") }
        conn.exec_params("SELECT pg_notify($1, lpad(n::text, 7000, '.')) FROM generate_series($2::int, $3::int) n",
                         [@channel, first, first + 19])
        expected.concat(burst)
        # The fast client reads each burst before the next: it is never more
        # than 20 messages behind, the slow one falls further behind each time.
        assert burst == fast.messages(burst.size), "the fast client gets every message in order"
      end
    end
    assert_equal({ "clients" => 1, "dropped" => 1 }, stats.slice("clients", "dropped"))
    publish("after the drop")
    assert_equal ["after the drop"], fast.messages(1)

    # What the slow client was sent before it was dropped, in order; then its stream ends.
    sent = []
    while (event = slow.next_event(timeout: 40))
      sent << event.data if event.event.nil? && event.data
    end
    assert_operator sent.size, :<, expected.size - 50, "at least the 50 queued for it were let go"
    assert expected.first(sent.size) == sent, "the slow client got a prefix of the messages, in order"
  end

  private

  # Starts `neverblock serve examples/notify_feed/config.ru` in its own
  # process group and waits until it listens.
  def serve(workers:, heartbeat: nil, queue_limit: nil)
    env = { "DATABASE_URL" => pg_url, "FEED_CHANNEL" => @channel }
    env["FEED_HEARTBEAT"] = heartbeat.to_s if heartbeat
    env["FEED_QUEUE_LIMIT"] = queue_limit.to_s if queue_limit
    @out, writer = IO.pipe
    @pid = Process.spawn(env, RbConfig.ruby, EXE, "serve", CONFIG_RU, "-b", "tcp://127.0.0.1:0", "-w", workers.to_s,
                         out: writer, err: writer, pgroup: true)
    writer.close
    @output = +""
    banner = Timeout.timeout(30) { @out.gets } or flunk "neverblock serve exited before listening"
    @output << banner
    @port = Integer(banner[/tcp:\/\/127\.0\.0\.1:(\d+)/, 1] || flunk("no address in #{banner.inspect}"))
    @reader = Thread.new do
      loop { @output << @out.readpartial(4096) }
    rescue EOFError, IOError
      nil
    end
  end

  # A client whose stream has begun: it got `event: ready` (its worker
  # LISTENs), so every message published from now on reaches it.
  def subscribe(**options)
    client = EventClient.new(@port, **options)
    @clients << client
    client.read_head
    assert_equal 200, client.status
    assert_equal "text/event-stream", client.headers["content-type"]
    ready = client.next_event
    ready = client.next_event while ready&.comment == "heartbeat" # before LISTEN is in effect, with a short heartbeat
    assert_equal "ready", ready&.event, "the first event: #{ready.inspect}; server output:\n#{@output}"
    client.worker = Integer(ready.data)
    client
  end

  def publish(payload)
    Net::HTTP.start("127.0.0.1", @port, open_timeout: 5, read_timeout: 10) do |http|
      http.post("/publish", payload, "content-type" => "text/plain")
    end
  end

  def stats
    JSON.parse(Net::HTTP.get(URI("http://127.0.0.1:#{@port}/stats")))
  end

  def raw_request(text)
    socket = TCPSocket.new("127.0.0.1", @port)
    socket.write(text)
    socket.wait_readable(10) or flunk "no response"
    socket.readpartial(4096)
  ensure
    socket&.close
  end

  # @return [Integer] the server's sessions whose last statement LISTENed on this test's channel.
  def listener_connections(conn)
    conn.exec_params("SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'LISTEN %' || $1 || '%'", [@channel])
        .getvalue(0, 0).to_i
  end

  def with_pg
    conn = PG.connect(**pg_conninfo)
    yield conn
  ensure
    conn&.close
  end

  def failure_context = "; server output:\n#{@output}"
end
