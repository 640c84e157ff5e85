# frozen_string_literal: true

# bench/streams.rb's app, the same under every server. Every stream is a
# text/event-stream whose Rack body streams with `each`:
#   GET /stream?events=40&interval_ms=50
#       `events` events, the first at once, the others on a fixed schedule
#       `interval_ms` apart (a late event does not push the later ones back):
#       the fake LLM, tokens at a set rate
#   GET /relay?events=40&interval_ms=50&upstream=PORT
#       the same events read from /stream of the server on 127.0.0.1:PORT (the
#       fake LLM upstream) with Net::HTTP's streaming read_body, each chunk
#       relayed as it arrives
#   &marked=1   the app first calls env["neverblock.mark_as_io_bound"] (only
#               NeverBlock has it): the stream holds no request slot
#   GET /ruby   the serving Ruby (PeerServers.check_ruby)
#   GET /stream-gaps  the streams' worst gaps as the app wrote them (StreamGaps)
#   anything else answers "ok" at once
require "net/http"
require_relative "ruby_description"
require_relative "stream_gaps"

# A stream of `count` events `interval` seconds apart.
class TokenEvents
  EVENT = "data: {\"index\":%d,\"token\":\"lorem\"}\n\n"

  def initialize(count, interval)
    @count = count
    @interval = interval
  end

  def each
    StreamGaps.record do |tick|
      due = now
      @count.times do |index|
        # A timer may fire a little early: sleep again until the event is due.
        while (left = due - now).positive?
          sleep(left)
        end
        tick.call
        yield format(EVENT, index)
        due += @interval
      end
    end
  end

  private

  def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
end

# The upstream's stream, relayed chunk by chunk as Net::HTTP reads it.
class RelayedEvents
  def initialize(port, query)
    @port = port
    @query = query
  end

  def each(&block)
    Net::HTTP.start("127.0.0.1", @port, read_timeout: 120) do |http|
      http.request_get("/stream?#{@query}&marked=1") do |response|
        raise "the upstream answered #{response.code}" unless response.code == "200"

        StreamGaps.record do |tick|
          response.read_body do |chunk|
            tick.call
            block.call(chunk)
          end
        end
      end
    end
  end
end

STREAM_HEADERS = { "content-type" => "text/event-stream", "cache-control" => "no-cache" }.freeze

run(lambda do |env|
  path = env["PATH_INFO"]
  case path
  when "/stream", "/relay"
    query = URI.decode_www_form(env["QUERY_STRING"].to_s).to_h
    events = Integer(query.fetch("events", 40))
    interval_ms = Integer(query.fetch("interval_ms", 50))
    env["neverblock.mark_as_io_bound"]&.call if query["marked"] == "1"
    body = if path == "/stream"
             TokenEvents.new(events, interval_ms / 1000.0)
           else
             RelayedEvents.new(Integer(query.fetch("upstream")), "events=#{events}&interval_ms=#{interval_ms}")
           end
    [200, STREAM_HEADERS.dup, body]
  when "/ruby" then [200, { "content-type" => "text/plain" }, [NeverBlockBench.ruby_description]]
  when "/stream-gaps" then [200, { "content-type" => "text/plain" }, [StreamGaps.report]]
  else [200, { "content-type" => "text/plain", "content-length" => "3" }, ["ok\n"]]
  end
end)
