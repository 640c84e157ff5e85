# frozen_string_literal: true

# What the kernel still holds of the bytes sent on TCP connections over
# 127.0.0.1, from /proc/net/tcp: a test that must know the server has read
# what a client sent (before it sends more, so that the server reads it
# separately) waits for that event instead of sleeping.
module SocketQueues
  # How often the table is read while waiting (seconds).
  POLL = 0.005

  module_function

  # Waits until the server listening on `server_port` has read every byte
  # each of `clients` sent: the client's send queue is empty, and the
  # server's end of the connection holds nothing unread (or is closed: it
  # answered and closed, having read what it read).
  # @param server_port [Integer]
  # @param clients [Array<Socket>] client sockets connected to it over 127.0.0.1
  # @param timeout [Numeric] seconds
  # @return [void]
  # @raise [RuntimeError] when some bytes are still unread after `timeout`
  def wait_until_read(server_port, clients, timeout: 30)
    ports = clients.map { |client| client.local_address.ip_port }
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + timeout
    loop do
      queues = self.queues
      unread = ports.reject do |port|
        sent, = queues[[port, server_port]]
        _, unread = queues[[server_port, port]]
        sent.to_i.zero? && unread.to_i.zero?
      end
      return if unread.empty?
      raise "the server on port #{server_port} left bytes of #{unread.size} connections unread for #{timeout} s" if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

      sleep POLL
    end
  end

  # @return [Hash{Array(Integer, Integer) => Array(Integer, Integer)}] by
  #   [local port, remote port] of each IPv4 TCP socket, its [send queue,
  #   receive queue] in bytes (of a listening socket, its accept backlog);
  #   where a closed connection (TIME_WAIT) had the same ports, the larger
  def queues
    File.foreach("/proc/net/tcp").drop(1).each_with_object({}) do |line, queues|
      _slot, local, remote, _state, sizes = line.split
      ports = [local[/\h+\z/].to_i(16), remote[/\h+\z/].to_i(16)]
      sizes = sizes.split(":").map { |hex| hex.to_i(16) }
      queues[ports] = queues.key?(ports) ? queues[ports].zip(sizes).map(&:max) : sizes
    end
  end
end
