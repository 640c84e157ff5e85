# frozen_string_literal: true

require_relative "debouncer_helper"
require "tmpdir"
require "securerandom"
require_relative "../../support/own_redis"

begin
  require "neverblock/debouncer/redis_store"
rescue LoadError => e
  REDIS_STORE_MISSING = "RedisStore not tested: #{e.message}"
end

# The Redis that bin/test starts (NEVERBLOCK_REDIS_URL); without it (a quick
# run of this file), a redis-server of the tests' own, on a unix socket in a
# temp dir, started on first use and stopped when the run ends.
module DebouncerRedisServer
  class << self
    # @return [String] the server's URL.
    def url
      @url ||= ENV.fetch("NEVERBLOCK_REDIS_URL") { start }
    end

    # @return [Boolean] true when there is a Redis to test against.
    def available?
      ENV.key?("NEVERBLOCK_REDIS_URL") || OwnRedis.redis_server?
    end

    private

    def start
      dir = Dir.mktmpdir("neverblock-redis")
      socket = File.join(dir, "redis.sock")
      pid = OwnRedis.spawn_redis(dir, socket)
      Minitest.after_run do
        Process.kill(:TERM, pid)
        Process.wait(pid)
        FileUtils.rm_rf(dir)
      end
      url = "unix://#{socket}"
      deadline = NeverBlock::Clock.now + 10
      sleep 0.02 until ready?(url) || NeverBlock::Clock.now > deadline
      raise "redis-server did not answer PING within 10 s" unless ready?(url)

      url
    end

    def ready?(url)
      client = RedisClient.new(url: url)
      client.call("PING") == "PONG"
    rescue RedisClient::Error
      false
    ensure
      client&.close
    end
  end
end

# The store protocol on a real Redis: coalescing across stores (as across
# processes), leases that expire, and nothing secret in Redis.
class DebouncerRedisStoreTest < NeverBlockTest
  include DebouncerHelper
  include OwnRedis
  neverblock_timeout 30

  def setup
    skip REDIS_STORE_MISSING if defined?(REDIS_STORE_MISSING)
    skip "RedisStore not tested: no NEVERBLOCK_REDIS_URL and no redis-server on PATH (bin/setup installs it)" unless
      DebouncerRedisServer.available?

    # Unique per run: bin/test --all runs every Ruby against one Redis, and a
    # value stored by the previous Ruby's run of this test would still be fresh.
    @prefix = "test:#{name}:#{Process.pid}-#{SecureRandom.hex(4)}:"
    @stores = []
    @redis = RedisClient.new(url: DebouncerRedisServer.url)
  end

  def teardown
    @stores&.each(&:close)
    @redis&.close
    super
  end

  def store(**options)
    NeverBlock::Debouncer::RedisStore.new(url: DebouncerRedisServer.url, prefix: @prefix, **options)
                                     .tap { |store| @stores << store }
  end

  def redis_keys
    @redis.scan("MATCH", "#{@prefix}*").to_a
  end

  # Two debouncers on two stores stand for two processes. Within each, the
  # requests coalesce in memory first ({NeverBlock::Debouncer::LocalFirst}):
  # only one request per store asks Redis.
  def test_debouncers_on_different_stores_make_one_upstream_call
    stores = [CountingStore.new(store), CountingStore.new(store)]
    entered = Queue.new
    upstream = Upstream.new(hold: -> { entered.size >= 40 && stores.sum(&:claims) >= 2 })
    first = NeverBlock::Debouncer.new(upstream, store: stores[0])
    second = NeverBlock::Debouncer.new(upstream, store: stores[1])
    app = lambda do |env|
      entered << true
      (env["PATH_INFO"] == "/report" ? first : second).call(env.merge("PATH_INFO" => "/r"))
    end

    results = concurrently(40) { |i| request(app, i.even? ? "/report" : "/other") }

    assert_equal 1, upstream.calls
    assert_equal [1, 1], stores.map(&:claims), "one claim in Redis per store, not one per request"
    assert_equal({ "leader" => 1, "follower" => 39 }, results.map { |_, headers, _| headers["x-debounce"] }.tally)
    assert_equal [[200, "call 1\n"]], results.map { |status, _, body| [status, body] }.uniq
    assert_empty redis_keys.grep(/lock:/), "the leader released its lock"
  end

  def test_a_stored_response_answers_another_store_for_ttl_seconds
    upstream = Upstream.new
    request(NeverBlock::Debouncer.new(upstream, ttl: 60, store: store), "/?b=2&a=1")

    status, headers, body = request(NeverBlock::Debouncer.new(upstream, ttl: 60, store: store), "/?a=1&b=2")

    assert_equal [200, "hit", "call 1\n", "1"], [status, headers["x-debounce"], body, headers["x-call"]]
    assert_equal 1, upstream.calls
    assert_equal 1, @stores.last.size
    ttl_ms = @redis.call("PTTL", redis_keys.grep(/value:/).first)
    assert_includes 1..60_000, ttl_ms
  end

  def test_redis_never_holds_a_credential_or_a_url
    upstream = Upstream.new { |_env, _n| [200, {}, ["ok"]] }
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60, share_credentials: :per_credential, store: store)

    request(debouncer, "/private-path?q=1", headers: { "Authorization" => "Bearer s3cret-token" })

    keys = redis_keys
    refute_empty keys
    stored = keys.map { |key| @redis.call("TYPE", key) == "string" ? @redis.call("GET", key) : "" }.join
    (keys + [stored]).each do |text|
      refute_includes text, "s3cret"
      refute_includes text, "private-path"
    end
  end

  def test_stale_while_revalidate_answers_stale_while_one_request_refreshes
    upstream = Upstream.new(delay: 0.2)
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 0.1, stale_while_revalidate: 30, store: store)
    request(debouncer, "/")
    sleep 0.2

    results = concurrently(5) { request(debouncer, "/") }
    sleep 0.01 until @stores.first.in_flight.zero?

    assert_equal({ ["stale", "call 1\n"] => 1, ["hit", "call 1\n"] => 4 },
                 results.map { |_, headers, body| [headers["x-debounce"], body] }.tally)
    assert_equal 2, upstream.calls, "one refresh"
    assert_equal ["hit", "call 2\n"], request(debouncer, "/").then { |_, headers, body| [headers["x-debounce"], body] }
  end

  def test_a_follower_takes_over_when_the_leaders_lock_expires
    upstream = Upstream.new
    debouncer = NeverBlock::Debouncer.new(upstream, wait_timeout: 10, store: store(poll_interval: 0.05))
    key = NeverBlock::Debouncer::Key.new.call(rack_env("/report"))
    # A leader whose process died holding the lock: nobody extends it.
    @redis.call("SET", "#{@prefix}lock:#{key}", "dead-leader", "PX", 300)

    status, headers, = request(debouncer, "/report")

    assert_equal [200, "leader"], [status, headers["x-debounce"]]
    assert_equal 1, upstream.calls
  end

  def test_a_live_leader_extends_its_lease_past_a_slow_upstream_call
    upstream = Upstream.new(delay: 1.0)
    debouncer = NeverBlock::Debouncer.new(upstream, store: store(lease: 0.3, poll_interval: 0.05))

    results = concurrently(5) { request(debouncer, "/slow") }

    assert_equal 1, upstream.calls, "no follower took over from a live leader"
    assert_equal [200], results.map(&:first).uniq
  end

  # Redis killed and restarted under a store that already listens: the
  # listener subscribes again and keeps extending leases, so a herd
  # against an upstream slower than the lease still makes one call.
  def test_after_redis_restarts_the_listener_resubscribes_and_leases_are_still_extended
    skip "needs redis-server on PATH" unless redis_server?
    dir = Dir.mktmpdir("neverblock-redis-restart")
    socket = File.join(dir, "redis.sock")
    pid = start_redis(dir, socket)
    url = "unix://#{socket}"
    # A 1.5 s lease, extended every 0.5 s (1 s to spare for a thread held up
    # by a loaded machine), and an upstream three leases slow.
    redis_store = NeverBlock::Debouncer::RedisStore.new(url: url, prefix: @prefix, lease: 1.5, poll_interval: 0.05,
                                                        redis_timeout: 1).tap { |s| @stores << s }
    upstream = Upstream.new(delay: 0.1)
    debouncer = NeverBlock::Debouncer.new(upstream, store: redis_store)
    assert_equal 200, request(debouncer, "/warm").first # the listener runs now
    assert_equal 1, pubsub_patterns(url)

    capture_log do
      stop_redis(pid)
      pid = nil
      NeverBlock.sleep(0.5) # the listener notices
      pid = start_redis(dir, socket)
      wait_until(30) { pubsub_patterns(url) == 1 }
    end

    slow = Upstream.new(delay: 4.5)
    herd = NeverBlock::Debouncer.new(slow, wait_timeout: 10, store: redis_store)
    results = concurrently(5) { request(herd, "/slow").first }
    assert_equal [200] * 5, results
    assert_equal 1, slow.calls, "a lease was not extended after Redis came back: a second leader called upstream"
  ensure
    redis_store&.close # before its Redis goes away, or the listener logs the loss again
    stop_redis(pid, dir)
  end

  def test_an_app_exception_gives_followers_502_and_stores_nothing
    stores = [CountingStore.new(store), CountingStore.new(store)]
    entered = Queue.new
    upstream = Upstream.new(hold: -> { entered.size >= 6 && stores.sum(&:claims) >= 2 }) { |_env, _n| raise "upstream down" }
    first = NeverBlock::Debouncer.new(upstream, ttl: 60, store: stores[0])
    second = NeverBlock::Debouncer.new(upstream, ttl: 60, store: stores[1])
    app = lambda do |env|
      entered << true
      (env["PATH_INFO"] == "/a" ? first : second).call(env.merge("PATH_INFO" => "/"))
    end

    results = concurrently(6) do |i|
      request(app, i.even? ? "/a" : "/b").first
    rescue RuntimeError
      :raised
    end

    assert_equal({ raised: 1, 502 => 5 }, results.tally)
    assert_equal 0, stores.first.size
  end

  def test_without_redis_requests_are_served_uncoalesced
    upstream = Upstream.new
    debouncer = NeverBlock::Debouncer.new(upstream, store: store_at_nowhere)

    log = capture_log { assert_equal 200, request(debouncer, "/").first }

    assert_match(/store failed/, log)
    assert_equal 1, upstream.calls
  end

  def wait_until(seconds)
    deadline = now + seconds
    until (value = yield)
      flunk "condition not met within #{seconds} s" if now > deadline
      NeverBlock.sleep(0.05)
    end
    value
  end

  def start_redis(dir, socket)
    pid = spawn_redis(dir, socket)
    wait_until(30) { pubsub_patterns("unix://#{socket}") }
    pid
  end

  # PUBSUB NUMPAT: pattern subscriptions (a live listener holds one); nil
  # while Redis does not answer.
  def pubsub_patterns(url)
    client = RedisClient.new(url: url)
    client.call("PUBSUB", "NUMPAT")
  rescue RedisClient::Error
    nil
  ensure
    client&.close
  end

  def store_at_nowhere
    NeverBlock::Debouncer::RedisStore.new(url: "unix://#{Dir.tmpdir}/neverblock-no-redis-#{Process.pid}.sock",
                                          redis_timeout: 1).tap { |store| @stores << store }
  end
end
