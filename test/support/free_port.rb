# frozen_string_literal: true

require "socket"

# For tests that need a port before the process that listens on it starts.
module FreePort
  # @return [Integer] a TCP port free right now on 127.0.0.1.
  def free_port
    server = TCPServer.new("127.0.0.1", 0)
    server.addr[1]
  ensure
    server&.close
  end
end
