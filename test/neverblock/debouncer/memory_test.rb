# frozen_string_literal: true

require_relative "debouncer_helper"

# Memory stays bounded: stored responses, the key map, and bodies.
class DebouncerMemoryTest < NeverBlockTest
  include DebouncerHelper
  neverblock_timeout 120

  KEYS = 100_000
  BODY = ("x" * 2048).freeze # 100,000 of these unbounded: ~200 MB

  def rss_kib
    File.read("/proc/self/status")[/^VmRSS:\s+(\d+)/, 1].to_i
  end

  def test_a_hundred_thousand_distinct_keys_keep_at_most_max_entries
    upstream = Upstream.new { |_env, _n| [200, {}, [BODY]] }
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 600, max_entries: 1000)
    request(debouncer, "/warm-up")
    GC.start
    before = rss_kib

    KEYS.times { |i| request(debouncer, "/item/#{i}") }
    GC.start

    assert_equal KEYS + 1, upstream.calls
    assert_equal 1000, debouncer.store.size
    assert_equal 0, debouncer.store.in_flight
    growth_mib = (rss_kib - before) / 1024.0
    # Half of what the bodies alone would take unbounded: the heap's own
    # growth over 100,000 requests varies with what the suite ran before
    # (68 and 86 MiB in two whole-suite runs on 3.1, under 64 alone); the
    # bodies kept (1,000 of them) are 2 MiB.
    assert_operator growth_mib, :<, 100, "RSS grew #{growth_mib.round} MiB; unbounded it would be ~200 MiB"
  end

  def test_the_least_recently_used_response_goes_first
    upstream = Upstream.new
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 600, max_entries: 2)

    request(debouncer, "/a")
    request(debouncer, "/b")
    request(debouncer, "/a") # a hit: /a is now the most recently used
    request(debouncer, "/c") # evicts /b

    assert_equal "hit", request(debouncer, "/a")[1]["x-debounce"]
    assert_equal "leader", request(debouncer, "/b")[1]["x-debounce"]
    assert_equal 2, debouncer.store.size
  end

  def test_a_body_larger_than_max_body_goes_to_the_leader_only
    chunks = Array.new(8) { |i| i.to_s * 1024 }
    [->(_env, _n) { [200, {}, chunks] }, ->(_env, _n) { [200, {}, chunks.each] }].each do |respond|
      upstream = Upstream.new(delay: 0.1, &respond)
      debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60, max_body: 4096)

      results = concurrently(4) { request(debouncer, "/big") }

      assert_equal [[200, chunks.join]], results.map { |status, _, body| [status, body] }.uniq
      assert_equal 4, upstream.calls, "followers go upstream themselves"
      assert_equal 0, debouncer.store.size
    end
  end

  def test_a_streamed_body_stops_when_the_leader_closes_it
    produced = 0
    closed = Thread::Queue.new
    body = Object.new
    body.define_singleton_method(:each) do |&block|
      100.times { |i| (produced += 1) && block.call(i.to_s * 1024) }
    end
    body.define_singleton_method(:close) { closed << true }
    debouncer = NeverBlock::Debouncer.new(->(_env) { [200, {}, body] }, max_body: 1024)

    _, _, leader_body = debouncer.call(rack_env("/big"))
    leader_body.each { |_chunk| break }
    leader_body.close

    assert NeverBlock.timeout(5) { closed.pop }, "the upstream body was closed"
    assert_operator produced, :<, 100, "the upstream stopped reading once the leader was gone"
  end
end
