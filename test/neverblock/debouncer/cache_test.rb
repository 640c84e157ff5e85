# frozen_string_literal: true

require_relative "debouncer_helper"

# What is shared with followers, what is stored with a ttl, and for how long.
class DebouncerCacheTest < NeverBlockTest
  include DebouncerHelper
  neverblock_timeout 30

  def respond_with(status = 200, **headers)
    ->(_env, n) { [status, { "content-type" => "text/plain" }.merge(headers), ["call #{n}\n"]] }
  end

  def test_without_ttl_nothing_is_stored
    upstream = Upstream.new
    debouncer = NeverBlock::Debouncer.new(upstream)

    2.times { request(debouncer, "/") }

    assert_equal 2, upstream.calls
    assert_equal 0, debouncer.store.size
  end

  def test_a_response_answers_identical_requests_for_ttl_seconds
    upstream = Upstream.new
    # A ttl of 2 s: a loaded machine's pause between the first two requests
    # must not expire the response (0.3 s did not leave room for one).
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 2)

    first = request(debouncer, "/?a=1&b=2")
    hit = request(debouncer, "/?b=2&a=1")
    sleep 2.2
    expired = request(debouncer, "/?a=1&b=2")

    assert_equal ["leader", "call 1\n"], [first[1]["x-debounce"], first[2]]
    assert_equal ["hit", "call 1\n"], [hit[1]["x-debounce"], hit[2]]
    assert_equal first[1].except("x-debounce"), hit[1].except("x-debounce")
    assert_equal ["leader", "call 2\n"], [expired[1]["x-debounce"], expired[2]]
  end

  def test_a_response_to_spoofed_forwarding_headers_answers_no_one_else
    upstream = Upstream.new { |env, n| [200, { "content-type" => "text/html" }, ["#{n}: http://#{env['HTTP_X_FORWARDED_HOST'] || env['HTTP_HOST']}/login"]] }
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 30)

    poisoned = request(debouncer, "/", headers: { "X-Forwarded-Host" => "evil.example" })
    innocent = request(debouncer, "/")
    spoofed_proto = request(debouncer, "/", headers: { "Forwarded" => "proto=https;host=evil.example" })

    assert_equal ["leader", "1: http://evil.example/login"], [poisoned[1]["x-debounce"], poisoned[2]]
    assert_equal ["leader", "2: http://example.test/login"], [innocent[1]["x-debounce"], innocent[2]]
    assert_equal "leader", spoofed_proto[1]["x-debounce"]
    assert_equal ["hit", "2: http://example.test/login"], request(debouncer, "/").then { |r| [r[1]["x-debounce"], r[2]] }
  end

  def test_a_conditional_or_partial_leader_does_not_answer_followers_that_asked_for_the_whole_response
    release = false
    upstream = Upstream.new(hold: -> { release }) do |env, _n|
      if env["HTTP_IF_NONE_MATCH"] then [304, { "etag" => '"v1"' }, []]
      elsif env["HTTP_RANGE"] then [206, { "content-range" => "bytes 0-1/10" }, ["01"]]
      else [200, { "etag" => '"v1"' }, ["0123456789"]]
      end
    end
    store = CountingStore.new(NeverBlock::Debouncer::MemoryStore.new)
    debouncer = NeverBlock::Debouncer.new(upstream, store: store)
    asks = [{ "If-None-Match" => '"v1"' }, { "Range" => "bytes=0-1" }, {}, {}]

    results = concurrently(asks.size) do |i|
      sleep 0.01 until store.claims >= i # the conditional and partial requests claim first
      release = true if i == asks.size - 1
      request(debouncer, "/", headers: asks[i])
    end

    assert_equal [[304, ""], [206, "01"], [200, "0123456789"], [200, "0123456789"]], results.map { |r| [r[0], r[2]] }
  end

  def test_cache_control_no_store_and_no_cache_are_never_stored
    %w[no-store no-cache].each do |directive|
      upstream = Upstream.new(&respond_with("cache-control" => directive))
      debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

      2.times { request(debouncer, "/") }

      assert_equal 2, upstream.calls, directive
    end
  end

  def test_max_age_shortens_the_ttl
    upstream = Upstream.new(&respond_with("cache-control" => "public, max-age=3"))
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    request(debouncer, "/")
    assert_equal "hit", request(debouncer, "/")[1]["x-debounce"] # (3 s: room for a loaded machine's pause)
    sleep 3.2
    assert_equal "leader", request(debouncer, "/")[1]["x-debounce"]
    assert_equal 2, upstream.calls
  end

  def test_max_age_zero_is_not_stored
    upstream = Upstream.new(&respond_with("cache-control" => "max-age=0"))
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    2.times { request(debouncer, "/") }

    assert_equal 2, upstream.calls
  end

  def test_a_response_with_set_cookie_is_never_shared_nor_stored
    upstream = Upstream.new(delay: 0.1) { |_env, n| [200, { "set-cookie" => "session=#{n}" }, ["call #{n}\n"]] }
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    results = concurrently(5) { request(debouncer, "/") }
    later = request(debouncer, "/")

    assert_equal 6, upstream.calls
    cookies = (results + [later]).map { |_, headers, _| headers["set-cookie"] }
    assert_equal 6, cookies.uniq.size, "each request got its own cookie: #{cookies.inspect}"
    assert_equal 0, debouncer.store.size
  end

  def test_cache_control_private_is_not_shared
    upstream = Upstream.new(delay: 0.1, &respond_with("cache-control" => "private"))
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    concurrently(4) { request(debouncer, "/") }

    assert_equal 4, upstream.calls
  end

  def test_a_5xx_is_shared_with_waiting_followers_but_never_stored
    upstream = Upstream.new(delay: 0.1, &respond_with(503))
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    results = concurrently(4) { request(debouncer, "/") }
    assert_equal [503], results.map(&:first).uniq
    assert_equal 1, upstream.calls

    request(debouncer, "/")
    assert_equal 2, upstream.calls
    assert_equal 0, debouncer.store.size
  end

  def test_followers_with_other_values_of_the_responses_vary_headers_do_not_get_the_leaders_response
    store = CountingStore.new(NeverBlock::Debouncer::MemoryStore.new)
    upstream = Upstream.new(hold: -> { store.claims >= 10 }) do |env, n|
      [200, { "vary" => "Accept-Language" }, ["#{env['HTTP_ACCEPT_LANGUAGE']} #{n}"]]
    end
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60, store: store)
    languages = %w[en de]

    results = concurrently(10) { |i| [languages[i % 2], request(debouncer, "/", headers: { "Accept-Language" => languages[i % 2] })] }

    results.each { |language, (_, _, body)| assert_equal language, body.split.first }
    assert_equal 2, upstream.calls, "the other language coalesces under its own key"
    assert_equal "de 2", request(debouncer, "/", headers: { "Accept-Language" => "de" })[2], "stored under its own key"
    assert_equal "en 1", request(debouncer, "/", headers: { "Accept-Language" => "en" })[2]
    assert_equal 2, upstream.calls
  end

  def test_vary_star_is_never_shared
    upstream = Upstream.new(delay: 0.1, &respond_with("vary" => "*"))
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    concurrently(3) { request(debouncer, "/") }

    assert_equal 3, upstream.calls
  end

  # The refresh waits until the test releases it, after the five were
  # answered: the first found the response stale and started it, the other
  # four found it in flight, however slowly the five arrive.
  def test_stale_while_revalidate_answers_stale_while_one_request_refreshes
    release = true # the first call answers at once
    upstream = Upstream.new(hold: -> { release })
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 1, stale_while_revalidate: 30)
    request(debouncer, "/")
    sleep 1.1 # past the ttl: stale

    release = false
    results = concurrently(5) { request(debouncer, "/") }
    released = now
    release = true
    sleep 0.01 until debouncer.store.in_flight.zero?

    assert_equal({ ["stale", "call 1\n"] => 1, ["hit", "call 1\n"] => 4 },
                 results.map { |_, headers, body| [headers["x-debounce"], body] }.tally)
    assert_equal 2, upstream.calls, "one refresh"
    role, body = request(debouncer, "/").then { |_, headers, text| [headers["x-debounce"], text] }
    assert_equal "call 2\n", body, "the refresh was stored"
    # Stored after the release, it is fresh for 1 s: unless a pause of the
    # machine outlasted that, a hit.
    assert_equal "hit", role unless now - released >= 1
  end

  def test_past_the_stale_window_a_request_waits_for_a_fresh_response
    upstream = Upstream.new
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 0.1, stale_while_revalidate: 0.1)
    request(debouncer, "/")
    sleep 0.3

    assert_equal ["leader", "call 2\n"], request(debouncer, "/").then { |_, headers, body| [headers["x-debounce"], body] }
  end
end
