# frozen_string_literal: true

require "socket"

# A TCP relay on 127.0.0.1 between a client under test and a server, run by
# threads of its own (outside any event loop), that lets a test choose what
# the client sees and when: it copies bytes both ways, and on request keeps
# the server's bytes back (#hold), passes them on one protocol message at a
# time (#release_through), or resets the client's connections (#reset: an
# RST, as from a server that died).
#
# Messages are PostgreSQL's (a type byte, then a 4-byte length that counts
# itself); #hold must be called between messages, when the server is not
# sending, and while one connection is open (#release_through passes the
# held bytes to the first).
#
#   relay = TcpRelay.new("127.0.0.1", 5432)
#   db = NeverBlock::Postgres.pool(host: "127.0.0.1", port: relay.port, ...)
#   relay.close
class TcpRelay
  # Seconds #release_through waits for the server's message.
  RELEASE_TIMEOUT = 10
  LINGER_RESET = [1, 0].pack("ii") # SO_LINGER on, 0 s: close sends an RST
  private_constant :LINGER_RESET

  # @param host [String] the server's
  # @param port [Integer]
  def initialize(host, port)
    @upstream = [host, port]
    @listener = TCPServer.new("127.0.0.1", 0)
    @lock = Thread::Mutex.new
    @arrived = Thread::ConditionVariable.new
    @pairs = [] # [client, server] sockets of each open connection
    @threads = []
    @holding = false
    @held = "".b
    @acceptor = Thread.new { accept_clients }
  end

  # @return [Integer] where clients connect (127.0.0.1)
  def port
    @listener.addr[1]
  end

  # From now on the server's bytes to its clients are kept back.
  # @return [void]
  def hold
    @lock.synchronize { @holding = true }
  end

  # Passes on the bytes kept back up to and including the first message of
  # `type` (e.g. "E", an ErrorResponse), once it has arrived; keeps the
  # rest back. The client has them in its socket when this returns.
  # @param type [String] one character
  # @return [void]
  # @raise [RuntimeError] if no such message arrives within RELEASE_TIMEOUT seconds
  def release_through(type)
    deadline = NeverBlock::Clock.now + RELEASE_TIMEOUT
    @lock.synchronize do
      until (length = length_through(type))
        remaining = deadline - NeverBlock::Clock.now
        raise "the server sent no #{type.inspect} message within #{RELEASE_TIMEOUT} s" if remaining <= 0

        @arrived.wait(@lock, remaining)
      end
      @pairs.first[0].write(@held.slice!(0, length))
    end
  end

  # Resets every client connection (the client's next read or write on it
  # fails with ECONNRESET, or reads its end), closes the server's side, and
  # drops the bytes held back: later connections are relayed as usual.
  # @return [void]
  def reset
    pairs = @lock.synchronize do
      @holding = false
      @held.clear
      @pairs.slice!(0..)
    end
    pairs.each do |client, server|
      quietly do
        client.setsockopt(Socket::SOL_SOCKET, Socket::SO_LINGER, LINGER_RESET)
        client.close
      end
      quietly { server.close }
    end
  end

  # Stops accepting, closes every connection and waits for its threads.
  # @return [void]
  def close
    @listener.close
    @acceptor.join
    reset
    @threads.each(&:join)
  end

  private

  def accept_clients
    loop do
      client = @listener.accept
      server = TCPSocket.new(*@upstream)
      pair = [client, server]
      @lock.synchronize { @pairs << pair }
      @threads << Thread.new { copy_to_server(client, server) } << Thread.new { copy_to_client(pair) }
    end
  rescue IOError, SystemCallError
    nil # closed
  end

  def copy_to_server(client, server)
    loop { server.write(client.readpartial(65_536)) }
  rescue EOFError, IOError, SystemCallError
    quietly { server.close_write }
  end

  # Server to client, or into the held bytes. When the server closes, so
  # does the client's side, unless bytes are being held back (the test
  # resets it).
  def copy_to_client(pair)
    client, server = pair
    loop do
      data = server.readpartial(65_536)
      @lock.synchronize do
        if @holding
          @held << data
          @arrived.broadcast
        else
          client.write(data)
        end
      end
    end
  rescue EOFError, IOError, SystemCallError
    closing = @lock.synchronize { !@holding && @pairs.delete(pair) }
    return unless closing

    quietly { client.close }
    quietly { server.close }
  end

  def quietly
    yield
  rescue IOError, SystemCallError
    nil
  end

  # Called with the lock held: how many held bytes run through the first
  # complete message of `type`; nil when none has arrived whole.
  def length_through(type)
    offset = 0
    while @held.bytesize >= offset + 5
      ending = offset + 1 + @held.byteslice(offset + 1, 4).unpack1("N")
      return nil if @held.bytesize < ending
      return ending if @held.byteslice(offset) == type

      offset = ending
    end
    nil
  end
end
