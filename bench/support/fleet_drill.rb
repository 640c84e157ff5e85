# frozen_string_literal: true

# The clients of the fleet drill (support/fleet.rb): keep-alive load, long requests, server-sent
# event streams that reconnect, and a herd; all through HAProxy on 127.0.0.1:PORT.
module NeverBlockFleet
  # Keep-alive GET / in `clients` threads until #stop, each on one connection (a new one after an
  # error), with no retry: a request is answered (2xx) or lost.
  class Load
    def initialize(port, clients, pause: 0)
      @port, @pause, @stop = port, pause, false
      @mutex = Mutex.new
      @sent = @answered = 0
      @errors = Hash.new(0)
      @threads = Array.new(clients) { Thread.new { run } }
    end

    # @return [Hash] :requests sent, :lost (no 2xx), :errors ("EOFError" => 2, "HTTP 503" => 1)
    def stop
      @stop = true
      @threads.each(&:join)
      { requests: @sent, lost: @sent - @answered, errors: @errors }
    end

    private

    def run
      http = nil
      http = request(http) until @stop
      http&.finish
    end

    # One GET / on `http` (a new connection for nil). @return [Net::HTTP, nil] the connection, nil after an error
    def request(http)
      http ||= NeverBlockFleet.http(@port)
      count { @sent += 1 }
      code = http.get("/").code
      count { code.start_with?("2") ? @answered += 1 : @errors["HTTP #{code}"] += 1 }
      sleep @pause if @pause.positive?
      http
    rescue StandardError => e
      count { @errors[e.class.name] += 1 }
      http&.finish rescue nil # rubocop:disable Style/RescueModifier -- closing a broken connection
      nil
    end

    def count(&) = @mutex.synchronize(&)
  end

  # `clients` threads, each reading GET /sse?SECONDS streams one after the other until #stop: a
  # stream that ends with the last chunk ended clean; one closed, reset or silent for 10 s before
  # it was cut. Each then reconnects (HAProxy picks the host).
  class Streams
    def initialize(port, clients, seconds)
      @port, @seconds, @stop = port, seconds, false
      @outcomes = Queue.new
      @threads = Array.new(clients) { Thread.new { read_stream until @stop } }
    end

    # Lets each client finish its stream. @return [Hash] :clean, :cut, :reconnects, :hosts (streams per host)
    def stop
      @stop = true
      @threads.each(&:join)
      outcomes = Array.new(@outcomes.size) { @outcomes.pop }
      { clean: outcomes.count { |o| o[:clean] }, cut: outcomes.count { |o| !o[:clean] },
        reconnects: outcomes.size - @threads.size, hosts: outcomes.map { |o| o[:host] }.compact.tally }
    end

    private

    def read_stream
      data = +"".b
      Socket.tcp("127.0.0.1", @port, connect_timeout: 5) do |socket|
        socket.write("GET /sse?#{@seconds} HTTP/1.1\r\nHost: fleet\r\n\r\n")
        until data.end_with?("\r\n0\r\n\r\n")
          break unless socket.wait_readable(10)

          data << socket.readpartial(16_384)
        end
      end
    rescue SystemCallError, IOError
      nil
    ensure
      @outcomes << { clean: data.start_with?("HTTP/1.1 200") && data.end_with?("\r\n0\r\n\r\n"), host: data[/data: (\S+)/, 1] }
    end
  end

  module_function

  # A keep-alive Net::HTTP to HAProxy that never retries on its own.
  def http(port, read_timeout: 10)
    Net::HTTP.new("127.0.0.1", port).tap do |http|
      http.open_timeout = 5
      http.read_timeout = read_timeout
      http.max_retries = 0
      http.start
    end
  end

  # A GET /slow?SECONDS that HAProxy sends to `host`. @return [Thread] whose value is the host that answered, or the error
  def long_request(port, host, seconds)
    Thread.new do
      response = http(port, read_timeout: seconds + 60).then { |h| h.get("/slow?#{seconds}", "x-fleet-host" => host).tap { h.finish } }
      response.code == "200" ? response.body.split.first : "HTTP #{response.code}"
    rescue StandardError => e
      e.class.name
    end
  end

  # `count` clients, each connected first, send GET /herd?KEY at once.
  # @return [Hash] :answered (200s), :calls (upstream calls it cost), :roles (x-debounce tally)
  def herd(fleet, count)
    fleet.upstream_calls # reads and resets the count
    connected = Queue.new
    gate = Queue.new
    key = "k#{rand(1 << 40)}"
    threads = Array.new(count) do
      Thread.new do
        client = http(fleet.port, read_timeout: 30)
        connected << true
        gate.pop
        client.get("/herd?#{key}").then { |response| [response.code, response["x-debounce"]] }
      rescue StandardError => e
        [e.class.name, nil]
      ensure
        connected << false unless client
        client&.finish
      end
    end
    count.times { connected.pop }
    count.times { gate << true }
    results = threads.map(&:value)
    { answered: results.count { |code, _| code == "200" }, calls: fleet.upstream_calls, roles: results.map(&:last).tally }
  end

  # Keep-alive load and event streams through HAProxy while every host in turn is deployed with
  # `variant` (Fleet#deploy), `long` long requests started on each just before it is drained.
  # @return [Hash] the load's counts, :long and :long_finished (on their own host), the streams'
  #   counts, :sessions_left (summed over hosts) and :deploy_seconds
  def drill(fleet, variant:, clients:, pause: 0, long:, slow:, streams:, stream_seconds:, drain:)
    load = Load.new(fleet.port, clients, pause: pause)
    sse = Streams.new(fleet.port, streams, stream_seconds)
    sleep 1
    started = now
    longs = []
    deploys = fleet.hosts.map do |host|
      longs.concat(Array.new(long) { [host, long_request(fleet.port, host, slow)] })
      sleep 0.3 # they reached the host
      fleet.deploy(host, variant, drain: drain)
    end
    deploy_seconds = now - started
    sleep 1
    finished = longs.count { |host, thread| thread.value == host }
    load.stop.merge(sse.stop).merge(long: longs.size, long_finished: finished, long_answers: longs.map { |_, t| t.value }.tally,
                                    sessions_left: deploys.sum { |d| d[:sessions] }, deploy_seconds: deploy_seconds)
  end
end
