# frozen_string_literal: true

# bench/connections.rb's app, the same under every server: GET / is hello
# world; GET /sse a text/event-stream with an event at every whole second
# (a broadcast all streams get at once) until the client goes away.
class Ticks
  def each
    tick = Process.clock_gettime(Process::CLOCK_REALTIME).floor
    loop do
      tick += 1
      # A timer may fire a little early: sleep again until the second is here.
      while (left = tick - Process.clock_gettime(Process::CLOCK_REALTIME)).positive?
        sleep(left)
      end
      yield "data: tick\n\n"
    end
  end
end

HELLO = [200, { "content-type" => "text/plain", "content-length" => "12" }.freeze, ["Hello world\n"].freeze].freeze

run(lambda do |env|
  next HELLO unless env["PATH_INFO"] == "/sse"

  # NeverBlock: a stream only waits, so it gives its request slot back
  # (without this, --fiber-pool, 1000, streams at most).
  env["neverblock.mark_as_io_bound"]&.call
  [200, { "content-type" => "text/event-stream", "cache-control" => "no-cache" }, Ticks.new]
end)
