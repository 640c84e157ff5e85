# frozen_string_literal: true

require_relative "../../test_helper"
require "socket"
require "neverblock/server"

# A burst of connections arriving together (2,000 event streams opened at
# once) is queued by the kernel while the server does not accept (busy, or its
# request slots all taken): no SYN is dropped, which the client would send
# again only after 1 s, then 3 s.
class ServerListenerBacklogTest < PlainTest
  BURST = 2000

  def test_two_thousand_connections_arriving_together_are_all_queued_while_nothing_accepts
    somaxconn = Integer(File.read("/proc/sys/net/core/somaxconn")) rescue nil # rubocop:disable Style/RescueModifier
    skip "the kernel caps a listen backlog at net.core.somaxconn (#{somaxconn.inspect}), below #{BURST}" unless somaxconn.to_i > BURST
    soft, hard = Process.getrlimit(:NOFILE)
    skip "#{BURST} sockets need a higher open-file limit (#{hard})" if hard != Process::RLIM_INFINITY && hard < BURST + 100
    Process.setrlimit(:NOFILE, BURST + 100, hard) if soft < BURST + 100

    listener = NeverBlock::Server::Listener.new("tcp://127.0.0.1:0").listen
    address = Socket.sockaddr_in(listener.port, "127.0.0.1")
    @sockets = Array.new(BURST) { Socket.new(:INET, :STREAM).tap { |socket| socket.connect_nonblock(address, exception: false) } }
    # On loopback the kernel completes a queued connection's handshake at once; a dropped SYN's retry comes after 1 s and 3 s.
    pending = @sockets
    deadline = now + 5
    until pending.empty? || now > deadline
      pending = pending.reject { |socket| socket.wait_writable(0) }
      sleep 0.05
    end
    assert_equal 0, pending.size, "#{pending.size} of #{BURST} connections were not queued (their SYNs dropped)"
    assert_equal BURST, listener.pending_connections
  ensure
    @sockets&.each(&:close)
    listener&.close
  end
end
