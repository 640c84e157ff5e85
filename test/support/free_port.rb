# frozen_string_literal: true

require "socket"

# For tests that need a port before the process that listens on it starts.
#
# A port from the kernel's ephemeral range (bind to port 0) is a poor choice
# here: the kernel picks the next one at random from the same range, so two
# calls can name the same port, and any outgoing connection may take it
# before the server listens. So ports come from below that range, are free
# on every address when handed out, and are never handed out twice by one
# process.
module FreePort
  # Below Linux's default ephemeral range (32768-60999).
  PORTS = (20_000..32_767)
  GIVEN = {}
  LOCK = Mutex.new

  # @return [Integer] a TCP port free right now, and not handed out before
  #   by this process.
  def free_port
    LOCK.synchronize do
      1000.times do
        port = rand(PORTS)
        next if GIVEN[port] || !FreePort.bindable?(port)

        return GIVEN[port] = port
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
end
