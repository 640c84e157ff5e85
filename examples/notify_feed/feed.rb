# frozen_string_literal: true

require "json"
require "neverblock/postgres"

# PostgreSQL LISTEN/NOTIFY as a server-sent events feed; config.ru (next to
# this file) says how to run it. In each worker process:
#
#   NOTIFY feed, '...'  (POST /publish, or any PostgreSQL client)
#        |
#   Hub: one listener task, LISTEN feed on a connection of its own
#        |  fan-out: every message into every client's queue, in order
#   EventStream per GET /events: pops its queue, writes `data:` lines,
#        a heartbeat comment when nothing came for `heartbeat` seconds
module NotifyFeed
  # PostgreSQL refuses a NOTIFY payload of 8000 bytes or more.
  MAX_PAYLOAD = 7999

  # The clients of one worker process and the task that LISTENs for them.
  #
  # The listener runs while the process has clients: the first one starts
  # it, the last one to leave stops it. So an idle worker holds no database
  # connection, and a stopping server is not kept waiting by a task that
  # never ends (NeverBlock::Server's loop ends when its last task does).
  #
  # Each client's queue is bounded: a client whose queue holds
  # `queue_limit` messages it has not been sent yet (it reads slower than
  # messages come) is dropped: its stream ends and it gets nothing more.
  # A client that stays connected has every message, in order; memory per
  # client stays under `queue_limit` messages.
  class Hub
    # @return [Integer] messages queued for clients since the start.
    attr_reader :delivered

    # @return [Integer] clients dropped for falling `queue_limit` behind.
    attr_reader :dropped

    # @param db [NeverBlock::Postgres::Client]
    # @param channel [String] the channel to LISTEN on.
    # @param queue_limit [Integer] messages a client may fall behind before it is dropped.
    def initialize(db, channel, queue_limit:)
      # PostgreSQL's identifiers (channel names) end at 63 bytes.
      raise ArgumentError, "channel names are at most 63 bytes, got #{channel.inspect}" if channel.bytesize > 63

      @db = db
      @channel = channel
      @queue_limit = queue_limit
      @clients = {}.compare_by_identity # queue => whether it was told :ready
      @listener = nil
      @listening = false
      @delivered = 0
      @dropped = 0
    end

    # Adds a client. Its queue gets `:ready` once this process LISTENs (at
    # once when it already does): every message NOTIFYed after that
    # follows, in order. The queue is closed when the client is dropped.
    # @return [Thread::Queue]
    def subscribe
      queue = Thread::Queue.new
      @clients[queue] = false
      if @listening
        ready(queue)
      else
        # Detached: it serves every client, not only the request that started it.
        @listener ||= NeverBlock.spawn(detached: true) { listen }
      end
      queue
    end

    # Removes a client (again is harmless); the last one stops the listener.
    # @return [void]
    def unsubscribe(queue)
      queue.close
      @clients.delete(queue)
      return unless @clients.empty? && @listener

      @listener.cancel
      @listener = nil
      @listening = false
    end

    # @return [Hash]
    def stats
      { pid: Process.pid, clients: @clients.size, listening: @listening, delivered: @delivered,
        dropped: @dropped, queue_limit: @queue_limit }
    end

    private

    # The listener task: LISTENs until cancelled, and again after a lost
    # connection (messages NOTIFYed meanwhile are lost: LISTEN/NOTIFY keeps
    # no history).
    def listen
      loop do
        listen_once
      rescue PG::Error, NeverBlock::ConnectError => e
        @listening = false
        NeverBlock.logger.warn("notify_feed: listening on #{@channel.inspect} failed (#{e.class}: #{e.message}); " \
                               "again in 1 s")
        sleep 1
      end
    end

    # Clients waiting for the LISTEN are told :ready once it is in effect
    # (`ready:`): a message NOTIFYed after that reaches them.
    def listen_once
      on_listen = lambda do
        @listening = true
        @clients.each_key { |queue| ready(queue) unless @clients[queue] }
      end
      @db.listen(@channel, ready: on_listen) do |payload|
        broadcast(payload)
        # The streams write what they got before the next notification: a
        # burst (one transaction's many NOTIFYs) arrives all at once, and
        # would otherwise fill every queue before any stream ran.
        sleep 0
      end
    end

    def ready(queue)
      @clients[queue] = true
      queue << :ready
    end

    def broadcast(payload)
      @clients.keys.each do |queue|
        next unless @clients[queue] # not told :ready yet: its stream starts after this message

        if queue.size >= @queue_limit
          drop(queue)
        else
          queue << payload
          @delivered += 1
        end
      end
    end

    # Its stream finds the queue closed and empty, ends the response and
    # unsubscribes; what was queued for it is let go at once.
    def drop(queue)
      queue.close
      queue.clear
      @clients.delete(queue)
      @dropped += 1
    end
  end

  # The body of one GET /events response (a Rack body the server iterates):
  # `event: ready` when the client is subscribed, then each message as
  # `data:` lines, and a comment line whenever `heartbeat` seconds pass
  # without one. The heartbeat also finds clients that left: writing to a
  # closed connection fails, the server closes the body, and {#close}
  # unsubscribes.
  class EventStream
    # @param hub [Hub]
    # @param heartbeat [Numeric] seconds
    def initialize(hub, heartbeat)
      @hub = hub
      @heartbeat = heartbeat
      @queue = hub.subscribe
    end

    # @yieldparam chunk [String] SSE text.
    def each
      loop do
        message = NeverBlock.timeout(@heartbeat) { @queue.pop }
        return if message.nil? # dropped: the queue was closed

        yield message == :ready ? "event: ready\ndata: #{Process.pid}\n\n" : event(message)
      rescue NeverBlock::TimeoutError
        yield ": heartbeat\n\n"
      end
    end

    # Called by the server when the response ends, however it ends.
    def close
      @hub.unsubscribe(@queue)
    end

    private

    # A payload's lines, each as a `data:` line (the client joins them with "\n").
    def event(payload)
      lines = payload.split(/\r\n|\r|\n/, -1)
      lines = [""] if lines.empty?
      "#{lines.map { |line| "data: #{line}\n" }.join}\n"
    end
  end

  # The Rack app: GET /events, POST /publish, GET /stats, and GET / (a page
  # that shows the feed in a browser).
  class App
    INDEX = File.expand_path("index.html", __dir__)

    # @param db [NeverBlock::Postgres::Client]
    # @param channel [String]
    # @param heartbeat [Numeric] seconds between heartbeats on an idle stream.
    # @param queue_limit [Integer] see {Hub}.
    def initialize(db:, channel:, heartbeat:, queue_limit:)
      @db = db
      @channel = channel
      @heartbeat = heartbeat
      @hub = Hub.new(db, channel, queue_limit: queue_limit)
    end

    def call(env)
      case [env["REQUEST_METHOD"], env["PATH_INFO"]]
      in ["GET", "/events"]
        [200, { "content-type" => "text/event-stream", "cache-control" => "no-cache",
                "x-accel-buffering" => "no" }, EventStream.new(@hub, @heartbeat)]
      in ["POST", "/publish"] then publish(env)
      in ["GET", "/stats"] then [200, { "content-type" => "application/json" }, [JSON.generate(@hub.stats)]]
      in ["GET", "/"] then [200, { "content-type" => "text/html; charset=utf-8" }, [File.read(INDEX)]]
      in [_, "/events" | "/publish" | "/stats" | "/"] then text(405, "method not allowed\n")
      else text(404, "not found\n")
      end
    end

    private

    # NOTIFYs the request body; 413 when PostgreSQL would refuse its size.
    def publish(env)
      payload = env["rack.input"].read(MAX_PAYLOAD + 1) || +"" # one byte past the limit is enough to know
      return too_large if payload.bytesize > MAX_PAYLOAD

      payload.force_encoding(Encoding::UTF_8)
      unless payload.valid_encoding? && !payload.include?("\0")
        return text(400, "the payload must be UTF-8 text without NUL bytes\n")
      end

      @db.notify(@channel, payload)
      text(202, "published #{payload.bytesize} bytes\n")
    end

    def too_large
      text(413, "payload too large: at most #{MAX_PAYLOAD} bytes\n")
    end

    def text(status, body)
      [status, { "content-type" => "text/plain" }, [body]]
    end
  end
end
