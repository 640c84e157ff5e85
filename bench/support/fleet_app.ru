# frozen_string_literal: true

# The app of bench/fleet.rb (and test/neverblock/server/fleet_test.rb), the same on every host of
# the fleet and under NeverBlock and Puma alike. Each answer names its host (NB_FLEET_HOST):
#   GET /          "host1 PID\n", at once
#   GET /slow?S    "host1 slow\n" after S seconds (a long request)
#   GET /sse?S     a server-sent event stream: "data: host1 N\n\n" NB_FLEET_SSE_RATE times a second
#                  for S seconds, then the stream ends (its client reconnects)
#   GET /herd?KEY  NB_FLEET_UPSTREAM's /config behind NeverBlock::Debouncer with a RedisStore at
#                  NB_FLEET_REDIS that all hosts share: one herd, one upstream call
#   GET /limited?S NB_FLEET_UPSTREAM's /config holding a permit of a NeverBlock::RedisSemaphore at
#                  NB_FLEET_REDIS that all hosts share (NB_FLEET_LIMIT, default 3; lease 2 s);
#                  503 when no permit came within S seconds (default 30)
#   GET /hold      takes a permit of that semaphore, streams "host1 PID\n", and keeps the permit
#                  until its worker dies
# NB_FLEET_LOAD_PATH (directories joined by ":") lets a peer server's bundle load NeverBlock's lib/
# and redis-client.
ENV.fetch("NB_FLEET_LOAD_PATH", "").split(":").reverse_each { |dir| $LOAD_PATH.unshift(dir) }
require "net/http"
require "neverblock/debouncer"
require "neverblock/debouncer/redis_store"
require "neverblock/redis_semaphore"

host = ENV.fetch("NB_FLEET_HOST", "host")
rate = Float(ENV.fetch("NB_FLEET_SSE_RATE", "5"))
upstream = URI("#{ENV.fetch('NB_FLEET_UPSTREAM', 'http://127.0.0.1:9')}/config")
text = ->(body) { [200, { "content-type" => "text/plain", "content-length" => body.bytesize.to_s }, [body]] }
fetch = lambda do |_env|
  answer = Net::HTTP.get_response(upstream)
  [Integer(answer.code), { "content-type" => "application/json" }, [answer.body]]
end
# Built in each worker on its first /herd or /limited (after the fork: its Redis connections are
# its own).
herd = nil
herd_lock = Mutex.new
limit = nil
limit_lock = Mutex.new
limited = lambda do
  limit_lock.synchronize do
    limit ||= NeverBlock::RedisSemaphore.new("fleet-limited", Integer(ENV.fetch("NB_FLEET_LIMIT", "3")),
                                             url: ENV.fetch("NB_FLEET_REDIS"), lease: 2)
  end
end

run(lambda do |env|
  query = env["QUERY_STRING"].to_s
  case env["PATH_INFO"]
  when "/slow"
    sleep(Float(query.empty? ? "3" : query))
    text.call("#{host} slow\n")
  when "/sse"
    env["neverblock.mark_as_io_bound"]&.call
    events = Enumerator.new do |stream|
      (Float(query.empty? ? "4" : query) * rate).ceil.times do |i|
        stream << "data: #{host} #{i}\n\n"
        sleep(1 / rate)
      end
    end
    [200, { "content-type" => "text/event-stream", "cache-control" => "no-cache" }, events]
  when "/herd"
    herd_lock.synchronize do
      herd ||= NeverBlock::Debouncer.new(fetch, store: NeverBlock::Debouncer::RedisStore.new(url: ENV.fetch("NB_FLEET_REDIS")))
    end
    herd.call(env)
  when "/limited"
    limited.call.acquire(timeout: Float(query.empty? ? "30" : query)) { fetch.call(env) }
  when "/hold"
    env["neverblock.mark_as_io_bound"]&.call
    held = Enumerator.new do |stream|
      limited.call.acquire do
        stream << "#{host} #{Process.pid}\n"
        sleep
      end
    end
    [200, { "content-type" => "text/plain" }, held]
  else
    text.call("#{host} #{Process.pid}\n")
  end
rescue NeverBlock::SemaphoreTimeout => e
  [503, { "content-type" => "text/plain" }, ["#{e.message}\n"]]
end)
