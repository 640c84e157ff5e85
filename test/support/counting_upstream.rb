# frozen_string_literal: true

require "socket"

# An upstream that counts: a TCP service on 127.0.0.1 that answers each
# line ("ok") after `hold` seconds and records how many calls it served at
# once; with `http: true`, each HTTP/1.1 request (its answer: "answer to
# PATH", then the connection closes). Tests of limits assert on what the upstream saw, not on what the
# callers believe. Runs on threads of the test process.
class CountingUpstream
  # @return [Integer] the port it listens on.
  attr_reader :port

  # @param hold [Numeric] seconds each call takes.
  # @param http [Boolean] calls are HTTP requests, not lines.
  def initialize(hold:, http: false)
    @hold = hold
    @http = http
    @server = TCPServer.new("127.0.0.1", 0)
    @port = @server.addr[1]
    @lock = Mutex.new
    @now = 0
    @most = 0
    @calls = 0
    @handlers = []
    @acceptor = Thread.new { loop { serve(@server.accept) } }
    @acceptor.report_on_exception = false
  end

  # @return [Integer] the most calls served at once.
  def most
    @lock.synchronize { @most }
  end

  # @return [Integer] calls received.
  def calls
    @lock.synchronize { @calls }
  end

  # Forgets the calls and the most so far.
  # @return [void]
  def reset
    @lock.synchronize do
      @calls = 0
      @most = @now
    end
  end

  # Stops accepting, and waits for the calls being answered to close their
  # connections (a test's leak check runs right after): a call that has had
  # its "ok" may still be closing. Calls still waiting are cut.
  # @return [void]
  def close
    @acceptor.kill
    @acceptor.join
    @server.close
    @lock.synchronize { @handlers.dup }.each { |handler| handler.join(2) || handler.kill.join }
  end

  private

  def serve(client)
    handler = Thread.new do
      path = @http ? read_http_request(client) : client.gets
      @lock.synchronize do
        @calls += 1
        @most = [@most, @now += 1].max
      end
      begin
        sleep @hold
      ensure
        @lock.synchronize { @now -= 1 }
      end
      @http ? answer_http(client, "answer to #{path}") : client.puts("ok")
    rescue SystemCallError, IOError
      nil
    ensure
      client.close
    end
    @lock.synchronize do
      @handlers.select!(&:alive?) # (nil when none ended)
      @handlers << handler
    end
  end

  # @return [String] the request's path, its head read.
  def read_http_request(client)
    path = client.gets.to_s.split[1]
    nil until ["\r\n", "\n", nil].include?(client.gets)
    path
  end

  def answer_http(client, body)
    client.write("HTTP/1.1 200 OK\r\ncontent-length: #{body.bytesize}\r\nconnection: close\r\n\r\n#{body}")
  end
end
