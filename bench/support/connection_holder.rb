# frozen_string_literal: true

require "socket"
require_relative "servers"

module NeverBlockBench
  # A forked child that opens `count` connections to 127.0.0.1:`port` and holds
  # them, idle after one GET / each, or each an event stream (GET /sse) that it
  # drains and counts; bench/connections.rb measures the server meanwhile.
  class ConnectionHolder
    BATCH = 100 # connections opened at once: below every server's listen backlog, so no SYN is dropped and retried

    attr_reader :opened # connections opened (each answered once)

    # Forks the holder and waits until it opened every connection.
    def self.start(port, count, sse:) = new(port, count, sse).tap(&:wait_opened)

    def initialize(port, count, sse)
      @from_child, to_parent = IO.pipe
      from_parent, @to_child = IO.pipe
      @pid = fork do
        [@from_child, @to_child].each(&:close)
        hold(port, count, sse, from_parent, to_parent)
        exit!(0)
      end
      [to_parent, from_parent].each(&:close)
    end

    def wait_opened
      line = @from_child.gets or raise "the connection holder died while opening"
      @opened = Integer(line[/\Aopened (\d+)/, 1] || raise("the holder failed: #{line.strip}"))
    end

    # Ends the holding: the child checks every connection, closes them and reports.
    # @return [Hash] :open (connections the server still had open), :events_per_second, :failure
    def finish
      @to_child.write("finish\n")
      report = Marshal.load(@from_child.read) # rubocop:disable Security/MarshalLoad -- our own child
      Process.wait(@pid)
      @pid = nil
      report
    end

    def kill
      NeverBlockBench.kill(@pid) if @pid
      @pid = nil
    end

    private

    def hold(port, count, sse, from_parent, to_parent)
      sockets = NeverBlockBench.split(count, (count + BATCH - 1) / BATCH).flat_map { |batch| open_batch(port, batch, sse) }
      to_parent.puts("opened #{sockets.size}")
      sockets.each { |socket| drain(socket) } if sse # events sent while the later streams were opened do not count
      started = NeverBlockBench.now
      events = 0
      events += (sse ? sockets.sum { |socket| drain(socket) } : 0) until from_parent.wait_readable(sse ? 0.2 : 1)
      open = sockets.count { |socket| open?(socket, sse) }
      to_parent.write(Marshal.dump({ open: open, events_per_second: events / (NeverBlockBench.now - started) }))
    rescue StandardError => e
      to_parent.puts("failed #{e.class}: #{e.message}")
      to_parent.write(Marshal.dump({ open: 0, failure: "#{e.class}: #{e.message}" }))
    end

    def open_batch(port, size, sse)
      sockets = Array.new(size) { Socket.tcp("127.0.0.1", port, connect_timeout: 10) }
      sockets.each { |socket| socket.write(RawHTTP.request(sse ? "/sse" : "/")) }
      deadline = NeverBlockBench.now + 30
      sockets.each do |socket|
        answered = sse ? RawHTTP.read_head(socket, deadline) : RawHTTP.read_response(socket, deadline)
        answered or raise "no response on a new connection"
      end
    end

    # @return [Integer] events read from a stream now
    def drain(socket)
      events = 0
      while (data = socket.read_nonblock(65_536, exception: false)).is_a?(String)
        events += data.scan("data: tick").size
      end
      events
    end

    # Whether the server still has the connection open: it answers a second request (idle), or sent no end of stream (sse).
    def open?(socket, sse)
      return socket.read_nonblock(65_536, exception: false) != nil && !socket.closed? if sse

      socket.write(RawHTTP.request)
      !RawHTTP.read_response(socket, NeverBlockBench.now + 10).nil?
    rescue SystemCallError, IOError
      false
    end
  end
end
