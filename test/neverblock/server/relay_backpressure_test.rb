# frozen_string_literal: true

require_relative "server_helper"

# An app that relays an upstream's streaming response (Net::HTTP's
# read_body, each chunk written on as it comes, as an LLM relay does) holds
# at most a chunk of it: a client that stops reading stops the relay's reads
# of the upstream, and the upstream's writes then wait in its kernel. What
# the upstream got out is bounded by the sockets' kernel buffers, however
# much it has to send; and when the client goes, the relay closes the
# upstream connection.
class ServerRelayBackpressureTest < PlainTest
  include ServerHelper

  CHUNK = "x" * 65_536
  # The sockets' buffers on the way hold less than this: the upstream's send
  # and the client's receive buffers are set small here, and the relay's
  # (its receive from the upstream, its send to the client) grow at most to
  # net.ipv4.tcp_rmem's and tcp_wmem's largest (32 and 4 MiB by default;
  # 4-8 MiB were held in practice), plus a margin for the chunks in Ruby.
  BOUND = [64 << 20, %w[tcp_rmem tcp_wmem].sum do |name|
    Integer(File.read("/proc/sys/net/ipv4/#{name}").split.last, exception: false) || (32 << 20)
  rescue SystemCallError
    32 << 20
  end + (16 << 20)].max
  # What the upstream would send, were it read: a relay that read ahead of
  # its client would take all of it in a second or two.
  OFFERED = 4 * BOUND
  SMALL_BUFFER = 65_536

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    @upstream = TCPServer.new("127.0.0.1", 0)
    @sent = 0
    @upstream_closed = Queue.new
    @upstream_thread = Thread.new { serve_upstream(@upstream.accept) }
  end

  def teardown
    super
  ensure
    @upstream_thread.kill.join(5)
    @upstream.close
    NeverBlock.logger = @logger
  end

  def test_a_client_that_stops_reading_stops_the_relays_reads_and_its_hang_up_closes_the_upstream
    start_server(relay(@upstream.addr[1]), adaptive_limit: false)
    client = Socket.new(:INET, :STREAM)
    client.setsockopt(Socket::SOL_SOCKET, Socket::SO_RCVBUF, SMALL_BUFFER) # before connecting: no autotuning
    client.connect(Socket.sockaddr_in(@port, "127.0.0.1"))
    (@sockets ||= []) << client
    client.write(get("/relay"))
    client.wait_readable(10) or flunk "no response head within 10 s"
    client.readpartial(4096) # the head and a first chunk; then the client reads nothing more

    steady = wait_until_steady
    assert_operator steady, :<, BOUND,
                    "the upstream got #{steady >> 20} MiB out to a relay whose client read nothing"
    assert_operator steady, :>, 0

    client.close
    assert_equal :closed, Timeout.timeout(10) { @upstream_closed.pop },
                 "the relay did not close the upstream connection once its client was gone"
    assert_operator @sent, :<, BOUND
    # The relay closes the upstream as the hang-up unwinds it (Net::HTTP's
    # ensure), before the server, further out, logs the request's end.
    eventually { @log.string.include?("GET /relay: the client hung up during its streamed response") }
  end

  private

  # A relay of GET upstream /stream: each chunk read is written on at once.
  def relay(port)
    lambda do |_env|
      body = Enumerator.new do |out|
        Net::HTTP.start("127.0.0.1", port, read_timeout: 30) do |http|
          http.request(Net::HTTP::Get.new("/stream")) do |response|
            response.read_body { |chunk| out << chunk }
          end
        end
      end
      [200, { "content-type" => "application/octet-stream" }, body]
    end
  end

  # The upstream (a plain thread, outside NeverBlock): a chunked response of
  # up to OFFERED bytes, written as fast as its reader takes them; @sent
  # counts what left. It reports the connection's close.
  def serve_upstream(socket)
    socket.setsockopt(Socket::SOL_SOCKET, Socket::SO_SNDBUF, SMALL_BUFFER)
    until (line = socket.gets).nil? || line == "\r\n"; end
    socket.write("HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    while @sent < OFFERED
      socket.write("#{CHUNK.bytesize.to_s(16)}\r\n#{CHUNK}\r\n")
      @sent += CHUNK.bytesize
    end
    socket.write("0\r\n\r\n")
  rescue Errno::EPIPE, Errno::ECONNRESET
    @upstream_closed << :closed
  ensure
    socket.close
  end

  # Bytes the upstream got out once that count stopped growing for a second
  # (within 30 s).
  def wait_until_steady
    last = -1
    steady_since = now
    deadline = now + 30
    while now < deadline
      current = @sent
      if current == last
        return current if now - steady_since >= 1
      else
        last = current
        steady_since = now
      end
      sleep 0.1
    end
    flunk "the upstream was still sending after 30 s (#{@sent >> 20} MiB)"
  end
end
