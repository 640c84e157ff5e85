# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "base64"
require "digest/sha1"
require "securerandom"

# A real Action Cable channel through `neverblock serve -w 2`: WebSocket
# clients (a minimal RFC 6455 client below) subscribe, and broadcasts made
# by HTTP requests (answered by either worker) reach every subscriber, on
# either worker, through the postgresql adapter.
class ServerActionCableTest < PlainTest
  include ServeProcesses
  include NeverBlockTest::Databases

  def test_broadcasts_reach_subscribers_on_both_workers
    server = serve("action_cable.ru", "-w", "2", env: { "DATABASE_URL" => pg_url })
    eventually { worker_pids(server[:pid]).size == 2 }
    workers = worker_pids(server[:pid])
    clients = []
    # Subscribers on both workers (the kernel picks the worker of each
    # connection). A worker still booting its Rails app (20 s on a loaded
    # machine) takes none: past ten clients, one more every 0.2 s until
    # both have some.
    deadline = NeverBlock::Clock.now + 60
    until (clients.map(&:worker).uniq.sort == workers.sort && clients.size >= 10) || NeverBlock::Clock.now > deadline
      sleep 0.2 if clients.size >= 10
      clients << CableClient.new(server[:port]).tap(&:subscribe)
    end
    assert_equal workers.sort, clients.map(&:worker).uniq.sort, "subscribers on both workers"
    served_by = Array.new(6) { |index| Integer(post(server, "/broadcast?hello-#{index}").body) }
    clients.each do |client|
      texts = Array.new(6) { client.next_message.fetch("text") }
      assert_equal Array.new(6) { |index| "hello-#{index}" }.sort, texts.sort, "every broadcast, whichever worker made it"
    end
    assert_empty served_by - workers
  rescue StandardError => e
    raise e.class, "#{e.message}\nserver output:\n#{server && output_lines(server).join}", e.backtrace
  ensure
    clients&.each(&:close)
  end

  private

  def post(server, path)
    Net::HTTP.start("127.0.0.1", server[:port], open_timeout: 5, read_timeout: 10) { |http| http.post(path, "") }
  end

  # Enough of a WebSocket client for Action Cable's JSON protocol: text
  # frames only, masked from the client, unmasked from the server.
  class CableClient
    IDENTIFIER = JSON.generate("channel" => "ChatChannel")

    def initialize(port)
      @socket = TCPSocket.new("127.0.0.1", port)
      key = Base64.strict_encode64(SecureRandom.random_bytes(16))
      @socket.write("GET /cable HTTP/1.1\r\nHost: 127.0.0.1:#{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n" \
                    "Sec-WebSocket-Key: #{key}\r\nSec-WebSocket-Version: 13\r\nOrigin: http://127.0.0.1:#{port}\r\n" \
                    "Sec-WebSocket-Protocol: actioncable-v1-json\r\n\r\n")
      head = +""
      head << @socket.readpartial(1) until head.end_with?("\r\n\r\n")
      raise "no upgrade: #{head}" unless head.start_with?("HTTP/1.1 101")

      accept = Base64.strict_encode64(Digest::SHA1.digest("#{key}258EAFA5-E914-47DA-95CA-C5AB0DC85B11"))
      raise "bad accept: #{head}" unless head.include?(accept)
      raise "no welcome" unless next_message(types: ["welcome"])
    end

    # @return [Integer, nil] the pid of the worker this client is connected to.
    attr_reader :worker

    # Subscribes to ChatChannel; the channel tells its worker's pid first.
    def subscribe
      send_text(JSON.generate("command" => "subscribe", "identifier" => IDENTIFIER))
      @worker = next_message.fetch("subscribed_in")
      next_message(types: ["confirm_subscription"])
    end

    # The next broadcast's message (or, with types:, the next message of one
    # of those types), skipping pings.
    def next_message(types: nil, timeout: 10)
      deadline = NeverBlock::Clock.now + timeout
      loop do
        raise "no message within #{timeout} s" if NeverBlock::Clock.now > deadline

        message = JSON.parse(read_frame(deadline))
        next if message["type"] == "ping"
        return message if types&.include?(message["type"])
        return message["message"] if types.nil? && message["message"]
      end
    end

    def close
      @socket.close
    end

    private

    def send_text(text)
      mask = SecureRandom.random_bytes(4)
      payload = text.b.bytes.each_with_index.map { |byte, index| byte ^ mask.getbyte(index % 4) }.pack("C*")
      length = payload.bytesize
      head = [0x81].pack("C") + (length < 126 ? [0x80 | length].pack("C") : [0x80 | 126, length].pack("Cn"))
      @socket.write(head + mask + payload)
    end

    def read_frame(deadline)
      first, second = read_bytes(2, deadline).unpack("CC")
      length = second & 0x7f
      length = read_bytes(2, deadline).unpack1("n") if length == 126
      length = read_bytes(8, deadline).unpack1("Q>") if length == 127
      payload = read_bytes(length, deadline)
      raise "not a text frame: opcode #{first & 0x0f}" unless (first & 0x0f) == 1

      payload.force_encoding(Encoding::UTF_8)
    end

    def read_bytes(count, deadline)
      data = +"".b
      while data.bytesize < count
        remaining = deadline - NeverBlock::Clock.now
        raise "timed out reading the cable" unless remaining.positive? && @socket.wait_readable(remaining)

        data << @socket.readpartial(count - data.bytesize)
      end
      data
    end
  end
end
