# frozen_string_literal: true

require "socket"

# An upstream that counts: a TCP service on 127.0.0.1 that answers each
# line ("ok") after `hold` seconds and records how many calls it served at
# once. Tests of limits assert on what the upstream saw, not on what the
# callers believe. Runs on threads of the test process.
class CountingUpstream
  # @return [Integer] the port it listens on.
  attr_reader :port

  # @param hold [Numeric] seconds each call takes.
  def initialize(hold:)
    @hold = hold
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
      client.gets
      @lock.synchronize do
        @calls += 1
        @most = [@most, @now += 1].max
      end
      begin
        sleep @hold
      ensure
        @lock.synchronize { @now -= 1 }
      end
      client.puts("ok")
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
end
