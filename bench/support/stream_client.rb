# frozen_string_literal: true

require "socket"
require_relative "servers"

module NeverBlockBench
  # bench/streams.rb's client: `processes` forked Ruby processes, each a
  # NeverBlock loop with a task per stream, open `count` streams (GET `path`,
  # `connection: close`) to 127.0.0.1:`port` at once, as fast as they can,
  # and time each one: its first event from the moment the batch started (the
  # parent's clock when it told the children to go: CLOCK_MONOTONIC is the
  # machine's, so the children measure from it too), its worst gap between two
  # reads that brought events, and its events, read until the server closes
  # it or `deadline` seconds after the start.
  #
  #   client = StreamClient.new(port, "/stream?events=40", 2000, processes: 2, deadline: 60)
  #   result = client.run { sample the server } # the block runs every 0.2 s until every child reported
  #   client.kill                                # in an ensure: the children, if they still run
  class StreamClient
    # One stream's outcome: `first` and `last` seconds from the start to its
    # first and last event (nil: none came), `worst_gap` seconds (0.0 with
    # fewer than two reads that brought events), `events` counted, `error`
    # (nil, or the text of what cut it short: a reset, a refusal, the
    # deadline, a bad status).
    Stream = Struct.new(:first, :worst_gap, :events, :error, :last)

    # `streams`: one {Stream} each; `cpu`: the children's CPU seconds (user +
    # system); `started`: the start ({NeverBlockBench.now}); `seconds`: from
    # the start until the last child reported.
    Result = Struct.new(:streams, :cpu, :started, :seconds)

    # How an event starts on the wire: counted in what a read brings (the
    # chunked framing around it never contains it).
    EVENT_START = "data: "
    SAMPLE_EVERY = 0.2 # seconds between two calls of #run's block

    def initialize(port, path, count, processes:, deadline:)
      @request = "GET #{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".freeze
      @address = Socket.sockaddr_in(port, "127.0.0.1")
      @deadline = deadline
      @children = NeverBlockBench.split(count, processes).map { |share| fork_child(share) }
    end

    # Waits until every child is ready, starts the batch, calls the block
    # every {SAMPLE_EVERY} seconds until every child reported.
    # @return [Result]
    def run
      @children.each { |child| child[:from].gets == "ready\n" or raise "a stream client died while starting" }
      started = NeverBlockBench.now
      @children.each { |child| child[:to].write("go #{started}\n") }
      pending = @children.map { |child| child[:from] }
      until pending.empty?
        yield if block_given?
        reported, = IO.select(pending, nil, nil, SAMPLE_EVERY) # a child writes its report as it ends
        pending -= reported if reported
      end
      reports = @children.map { |child| report_of(child) }
      Result.new(reports.flat_map { |report| report[:streams] }, reports.sum { |report| report[:cpu] }, started,
                 NeverBlockBench.now - started)
    end

    # @param streams [Array<Stream>]
    # @return [Integer] the most streams open at once, each from its first event to its last
    def self.peak_open(streams)
      # [time, 0 for a start or 1 for an end, change]: at the same instant a start sorts first,
      # so that a stream whose events all came in one read counts as open.
      edges = streams.select(&:first).flat_map { |stream| [[stream.first, 0, 1], [stream.last, 1, -1]] }.sort
      open = 0
      edges.map { |*, change| open += change }.max || 0
    end

    # Kills the children still running.
    def kill
      @children.each { |child| NeverBlockBench.kill(child[:pid]) if child[:pid] }
    end

    private

    def fork_child(share)
      from_child, to_parent = IO.pipe
      from_parent, to_child = IO.pipe
      pid = fork do
        [from_child, to_child].each(&:close)
        child(share, from_parent, to_parent)
        exit!(0)
      end
      [to_parent, from_parent].each(&:close)
      { pid: pid, from: from_child, to: to_child }
    end

    def report_of(child)
      data = child[:from].read
      Process.wait(child[:pid])
      child[:pid] = nil
      raise "a stream client died" if data.empty?

      Marshal.load(data) # rubocop:disable Security/MarshalLoad -- our own child
    end

    # In a child: opens `share` streams once the parent says go, reports.
    def child(share, from_parent, to_parent)
      require "neverblock"
      Machine.raise_fd_limit(share + 100)
      to_parent.write("ready\n")
      started = Float(from_parent.gets[/\Ago (\S+)/, 1])
      cpu = Process.times
      streams = NeverBlock.run do
        # Every connect and request first, in one go (a task's spawn costs a turn of the
        # loop, on which the streams already open are read); then a task per stream reads it.
        opened = Array.new(share) { open_stream }
        send_when_connected(opened, NeverBlockBench.now + CONNECT_PASSES)
        opened.map { |socket, outcome| NeverBlock.spawn { finish_stream(socket, outcome, started) } }.map(&:value)
      end
      times = Process.times
      to_parent.write(Marshal.dump({ streams: streams, cpu: times.utime - cpu.utime + times.stime - cpu.stime }))
    rescue Exception => e # rubocop:disable Lint/RescueException -- reported to the parent
      to_parent.write(Marshal.dump({ streams: [Stream.new(nil, 0.0, 0, "client: #{e.class}: #{e.message}")] * share, cpu: 0.0 }))
    end

    # Connects without waiting and, if connected at once (the server's accept queue had
    # room), sends the request. @return [Array(Socket, Stream)] the socket (nil if refused)
    #   and the stream's outcome, `events` -1 until the request is sent
    def open_stream
      outcome = Stream.new(nil, 0.0, -1, nil)
      socket = Socket.new(:INET, :STREAM)
      if socket.connect_nonblock(@address, exception: false) == 0
        # A new socket's send buffer takes the whole request.
        raise "the request did not fit a new socket's send buffer" unless socket.write_nonblock(@request) == @request.bytesize

        outcome.events = 0
      end
      [socket, outcome]
    rescue StandardError => e
      socket&.close
      [nil, failed(outcome, e)]
    end

    # Seconds {#send_when_connected} looks for connects that finished.
    CONNECT_PASSES = 0.2

    # A non-blocking connect nearly always finishes after connect(2) returns,
    # even on loopback. Looks again at those still connecting, every few
    # milliseconds until `deadline`, and sends the request on each that
    # connected: left to their tasks (#finish_stream), the last of a thousand
    # spawned would send its request after a thousand turns of the loop, on
    # a loaded machine seconds later, past a server's idle timeout for a new
    # connection (NeverBlock's is 5 s).
    def send_when_connected(opened, deadline)
      connecting = opened.select { |socket, outcome| socket && outcome.events.negative? }
      until connecting.empty? || NeverBlockBench.now > deadline
        connecting.reject! do |socket, outcome|
          next false if socket.connect_nonblock(@address, exception: false) == :wait_writable

          raise "the request did not fit a new socket's send buffer" unless socket.write_nonblock(@request) == @request.bytesize

          outcome.events = 0
          true
        rescue SystemCallError
          true # refused or reset: its task's connect reports it
        end
        NeverBlock.sleep(0.005) unless connecting.empty?
      end
    end

    # The rest of one stream, in its own task: the connect and request if
    # {#open_stream} could not finish them, then its events. @return [Stream]
    def finish_stream(socket, outcome, started)
      return outcome unless socket

      deadline = started + @deadline
      if outcome.events.negative?
        connect(socket, deadline)
        socket.write(@request)
        outcome.events = 0
      end
      read_events(socket, started, deadline, outcome)
    rescue StandardError => e
      failed(outcome, e)
    ensure
      socket&.close
    end

    def failed(outcome, error)
      outcome.events = 0 if outcome.events.negative?
      outcome.error = "#{error.class}: #{error.message.lines.first&.strip}"
      outcome
    end

    # Waits for a connect begun without waiting ({#open_stream}) to finish.
    def connect(socket, deadline)
      wait(socket, :wait_writable, deadline, "connecting")
      error = socket.getsockopt(:SOCKET, :ERROR).int
      raise SystemCallError.new("connect(2) for 127.0.0.1", error) unless error.zero?
    end

    # Reads the response until EOF, counting events and timing their arrival into `outcome`.
    def read_events(socket, started, deadline, outcome)
      head = +"".b
      body = false # the head has been read
      carry = +"".b # the last bytes of the body so far: an event start may be cut between two reads
      last = nil
      loop do
        data = socket.read_nonblock(16_384, exception: false)
        if data == :wait_readable
          wait(socket, :wait_readable, deadline, "reading")
          next
        end
        return outcome unless data # EOF: the server ended the stream

        at = NeverBlockBench.now
        if body
          text = carry << data
        else
          head << data
          next unless (split = head.index("\r\n\r\n"))

          raise "status #{head[/\AHTTP\/1\.1 (\d+)/, 1] || head[0, 20].inspect}" unless head.start_with?("HTTP/1.1 200")

          text = head.byteslice(split + 4..)
          body = true
        end
        count = text.scan(EVENT_START).size
        carry = text.byteslice([text.bytesize - EVENT_START.bytesize + 1, 0].max..)
        next if count.zero?

        outcome.first ||= at - started
        outcome.last = at - started
        outcome.worst_gap = at - last if last && at - last > outcome.worst_gap
        last = at
        outcome.events += count
      end
    end

    def wait(socket, how, deadline, doing)
      left = deadline - NeverBlockBench.now
      return if left.positive? && socket.public_send(how, left)

      raise Timeout, "still #{doing} at the deadline"
    end

    # A stream that had not ended at the deadline.
    class Timeout < StandardError; end
  end
end
