# frozen_string_literal: true

require "socket"

# For tests that need a port before the process that listens on it starts.
#
# A port from the kernel's ephemeral range (bind to port 0) is a poor choice
# here: the kernel picks the next one at random from the same range, so two
# calls can name the same port, and any outgoing connection may take it
# before the server listens. So ports come from below that range, are free
# on every address when handed out, and are claimed for the life of the
# process: never handed out twice, by this process or by another test
# process running beside it (bin/test --jobs). The claim is an abstract Unix
# socket named after the port, which the kernel drops when the process ends.
module FreePort
  # Below Linux's default ephemeral range (32768-60999).
  PORTS = (20_000..32_767)
  CLAIMS = {} # port => the socket that claims it
  LOCK = Mutex.new

  # @return [Integer] a TCP port free right now, and not handed out before
  #   by this process or another test process that is still running.
  def free_port
    LOCK.synchronize do
      1000.times do
        port = rand(PORTS)
        next if CLAIMS.key?(port) || !FreePort.bindable?(port)

        claim = FreePort.claim(port) or next
        CLAIMS[port] = claim
        return port
      end
      raise "no free TCP port in #{PORTS}"
    end
  end

  # @return [Boolean] whether a listener could bind `port` on every address.
  def self.bindable?(port)
    TCPServer.new("0.0.0.0", port).close
    true
  rescue Errno::EADDRINUSE, Errno::EACCES
    false
  end

  # @return [UNIXServer, nil] a socket bound to the port's abstract name (as
  #   the fleet claims its slot, bench/support/fleet.rb), or nil when
  #   another process holds it.
  def self.claim(port)
    UNIXServer.new("\0neverblock-test-port-#{port}")
  rescue Errno::EADDRINUSE
    nil
  end
end
