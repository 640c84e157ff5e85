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

  # Server-sent event clients through HAProxy: `clients` threads, each reading GET /sse?SECONDS
  # streams one after the other until #stop, and as many more (#pin) whose first stream HAProxy
  # sends to a given host (x-fleet-host). A stream ended clean
  # when it came whole: a 200, every event it should have (SECONDS * rate, numbered from 0, each
  # ended by its blank line, all from one host) and the chunked body's last chunk; otherwise (closed,
  # reset, silent for 10 s, an event short) it was cut. A client reconnects at once (HAProxy picks
  # the host).
  class Streams
    Stream = Struct.new(:client, :host, :started, :ended, :clean, keyword_init: true)

    def initialize(port, clients, seconds, rate)
      @port, @seconds, @stop = port, seconds, false
      @events = (seconds * rate).ceil
      @streams = Queue.new
      @threads = Array.new(clients) { |client| Thread.new { read_stream(client) until @stop } }
    end

    # One more client for two streams: the first served by `host` (HAProxy's use-server), the second
    # wherever HAProxy sends its reconnect. (Only two: on Pitchfork's six workers each stream client
    # takes one.)
    def pin(host)
      @threads << Thread.new { 2.times { |i| read_stream("#{host} pinned", i.zero? ? host : nil) } }
    end

    # Lets each client finish its stream. `deploys` (Fleet#deploy's answers) say when each host was out of
    # the balancer: a stream served by a host when it went out, and followed by its client's next stream,
    # was deployed; it moved when that next stream came from another host, and stayed when it began while
    # the host was still out and yet came from it (a reconnect begun after the host was back in may rightly
    # land there). (A stream with no next one, a pinned client's second, counts only as clean or cut.)
    # @return [Hash] :clean, :cut, :reconnects, :hosts (streams per host), :deployed, :moved, :stayed (descriptions)
    def stop(deploys = [])
      @stop = true
      @threads.each(&:join)
      streams = Array.new(@streams.size) { @streams.pop }.sort_by(&:started)
      deployed = streams.filter_map do |st|
        deploy = deploys.find { |d| d[:host] == st.host && st.started < d[:out] && d[:out] < st.ended }
        after = streams.find { |other| other.client == st.client && other.started >= st.ended }
        [st, deploy, after] if deploy && after
      end
      moved = deployed.count { |st, _, after| after.host && after.host != st.host }
      stayed = deployed.select { |st, d, after| after.host == st.host && after.started < d[:in] }
      { clean: streams.count(&:clean), cut: streams.count { |st| !st.clean }, reconnects: streams.map(&:client).tally.sum { |_, n| n - 1 },
        hosts: streams.map(&:host).compact.tally, deployed: deployed.size, moved: moved,
        stayed: stayed.map { |st, d, after| "#{st.client} on #{st.host}: reconnected #{(d[:in] - after.started).round(2)} s before it was back, to it" } }
    end

    private

    # One stream (to `host` if given). @return [Boolean] whether it ended clean
    def read_stream(client, host = nil)
      started = NeverBlockFleet.now
      data = receive(host)
      events = whole_events(data)
      clean = !events.nil? && events == Array.new(@events) { |i| "data: #{events.first&.split&.at(1)} #{i}" }
      @streams << Stream.new(client: client, host: data[/data: (\S+)/, 1], started: started, ended: NeverBlockFleet.now, clean: clean)
      clean
    end

    # @return [String] what the stream's connection received before its last chunk, a close or 10 s of silence
    def receive(host)
      data = +"".b
      Socket.tcp("127.0.0.1", @port, connect_timeout: 5) do |socket|
        socket.write("GET /sse?#{@seconds} HTTP/1.1\r\nHost: fleet\r\n#{"x-fleet-host: #{host}\r\n" if host}\r\n")
        until data.end_with?("\r\n0\r\n\r\n")
          break unless socket.wait_readable(10)

          data << socket.readpartial(16_384)
        end
      end
      data
    rescue SystemCallError, IOError
      data
    end

    # The events of a 200 with a chunked body that ended with its last chunk, each ended by a blank
    # line; nil for anything else.
    def whole_events(response)
      head, rest = response.split("\r\n\r\n", 2)
      return unless rest && head.start_with?("HTTP/1.1 200") && head.match?(/^transfer-encoding: *chunked\r?$/i)

      body = +""
      loop do
        size, rest = rest.split("\r\n", 2)
        return unless rest && size.match?(/\A\h+/)

        size = size.to_i(16)
        return rest == "\r\n" && body.end_with?("\n\n") ? body.split("\n\n") : nil if size.zero?
        return unless rest.byteslice(size, 2) == "\r\n"

        body << rest.byteslice(0, size)
        rest = rest.byteslice((size + 2)..)
      end
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
  # `variant` (Fleet#deploy), `long` long requests and one event stream started on each just before
  # it is drained.
  # @return [Hash] the load's counts, :long and :long_finished (on their own host), the streams'
  #   counts (Streams#stop), :sessions_left (summed over hosts) and :deploy_seconds
  def drill(fleet, variant:, clients:, pause: 0, long:, slow:, streams:, stream_seconds:, drain:)
    load = Load.new(fleet.port, clients, pause: pause)
    sse = Streams.new(fleet.port, streams, stream_seconds, fleet.sse_rate)
    sleep 1
    started = now
    longs = []
    deploys = fleet.hosts.map do |host|
      longs.concat(Array.new(long) { [host, long_request(fleet.port, host, slow)] })
      sse.pin(host)
      sleep 0.3 # they reached the host
      fleet.deploy(host, variant, drain: drain)
    end
    deploy_seconds = now - started
    sleep 1
    finished = longs.count { |host, thread| thread.value == host }
    load.stop.merge(sse.stop(deploys)).merge(long: longs.size, long_finished: finished, long_answers: longs.map { |_, t| t.value }.tally,
                                             sessions_left: deploys.sum { |d| d[:sessions] }, deploy_seconds: deploy_seconds)
  rescue StandardError # a deploy that raised: the clients stop too, not spin against a fleet being stopped
    load&.stop
    sse&.stop
    raise
  end
end
