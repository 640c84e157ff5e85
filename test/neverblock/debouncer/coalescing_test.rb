# frozen_string_literal: true

require_relative "debouncer_helper"

# A herd of identical requests makes one upstream call, served over real sockets.
class DebouncerCoalescingTest < NeverBlockTest
  include ServerHelper
  include DebouncerHelper
  neverblock_timeout 60

  HERD = 500

  def test_a_herd_of_identical_gets_makes_one_upstream_call_and_gets_identical_responses
    store = CountingStore.new(NeverBlock::Debouncer::MemoryStore.new)
    upstream = Upstream.new(hold: -> { store.claims >= HERD }) do |_env, n|
      [200, { "content-type" => "text/plain", "x-call" => n.to_s, "etag" => "\"v#{n}\"" }, ["call #{n}\n"]]
    end
    start_server(NeverBlock::Debouncer.new(upstream, store: store), fiber_pool: HERD + 10)

    responses = concurrently(HERD) do
      socket = TCPSocket.new("127.0.0.1", @port)
      socket.write(get("/report?b=2&a=1"))
      read_response(socket, timeout: 30)
    ensure
      socket&.close
    end

    assert_equal 1, upstream.calls
    roles = responses.map { |_, headers, _| headers.delete("x-debounce") }
    assert_equal({ "leader" => 1, "follower" => HERD - 1 }, roles.tally)
    responses.each { |_, headers, _| headers.delete("date") } # the server's own, per response
    assert_equal [[200, "call 1\n", "1", "\"v1\""]],
                 responses.map { |status, headers, body| [status, body, headers["x-call"], headers["etag"]] }.uniq
    assert_equal 1, responses.map { |_, headers, _| headers }.uniq.size, "every follower gets every header"
  end

  def test_query_parameter_order_does_not_matter
    upstream, debouncer = herd(30)
    targets = ["/items?a=1&b=2&c=3", "/items?c=3&a=1&b=2", "/items?b=2&c=3&a=1"]

    results = concurrently(30) { |i| request(debouncer, targets[i % 3]) }

    assert_equal 1, upstream.calls
    assert_equal ["call 1\n"], results.map(&:last).uniq
  end

  def test_repeated_parameters_keep_their_order_in_the_key
    upstream, debouncer = herd(10)

    concurrently(10) { |i| request(debouncer, i.even? ? "/?a=1&a=2" : "/?a=2&a=1") }

    assert_equal 2, upstream.calls
  end

  def test_paths_hosts_and_methods_are_distinct_keys
    upstream, debouncer = herd(40)
    variants = [["/a", {}], ["/b", {}], ["/a", { method: "HEAD" }], ["/a", { headers: { "Host" => "other.test" } }]]

    concurrently(40) { |i| request(debouncer, variants[i % 4][0], **variants[i % 4][1]) }

    assert_equal 4, upstream.calls
  end

  def test_configured_vary_headers_split_keys
    upstream, debouncer = herd(30, vary: ["Accept-Language"]) { |env, n| [200, {}, ["#{env['HTTP_ACCEPT_LANGUAGE']} #{n}"]] }
    languages = %w[en de fr]

    results = concurrently(30) { |i| [languages[i % 3], request(debouncer, "/", headers: { "Accept-Language" => languages[i % 3] })] }

    assert_equal 3, upstream.calls
    results.each { |language, (_, _, body)| assert_equal language, body.split.first }
  end

  def test_unsafe_methods_pass_straight_through
    upstream = Upstream.new(delay: 0.05)
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    results = concurrently(10) { |i| request(debouncer, "/orders", method: %w[POST PUT DELETE PATCH][i % 4]) }

    assert_equal 10, upstream.calls
    assert(results.none? { |_, headers, _| headers.key?("x-debounce") })
  end

  def test_a_get_with_a_body_passes_straight_through
    upstream = Upstream.new(delay: 0.05)
    debouncer = NeverBlock::Debouncer.new(upstream)

    concurrently(5) { request(debouncer, "/search", headers: { "Content-Length" => "2" }) }

    assert_equal 5, upstream.calls
  end

  def test_a_body_of_mixed_encodings_is_shared_byte_for_byte
    chunks = ["caf\u00e9 ", "\xFF\xFE".b]
    upstream, debouncer = herd(3) { |_env, _n| [200, {}, chunks] }

    results = concurrently(3) { request(debouncer, "/bytes") }

    assert_equal [chunks.map(&:b).join], results.map { |_, _, body| body.b }.uniq
    assert_equal 1, upstream.calls
  end

  def test_unsafe_methods_cannot_be_configured
    error = assert_raises(ArgumentError) { NeverBlock::Debouncer.new(Upstream.new, methods: %w[GET POST]) }
    assert_match(/POST/, error.message)
  end

  private

  # An upstream that answers once all `count` requests of a herd have
  # claimed their keys (leaders and followers alike), and a debouncer in
  # front of it: a fixed delay let a request that a loaded machine started
  # late find its key's call already over, and make a second one.
  def herd(count, **options, &respond)
    store = CountingStore.new(NeverBlock::Debouncer::MemoryStore.new)
    upstream = Upstream.new(hold: -> { store.claims >= count }, &respond)
    [upstream, NeverBlock::Debouncer.new(upstream, store: store, **options)]
  end
end

# Without NeverBlock: plain threads calling the middleware, as under any threaded Rack server.
class DebouncerThreadsTest < PlainTest
  include DebouncerHelper

  def test_fifty_threads_make_one_upstream_call
    store = CountingStore.new(NeverBlock::Debouncer::MemoryStore.new)
    upstream = Upstream.new(hold: -> { store.claims >= 50 })
    debouncer = NeverBlock::Debouncer.new(upstream, store: store)

    results = Array.new(50) { Thread.new { request(debouncer, "/report") } }.map(&:value)

    refute NeverBlock.neverblocking?
    assert_equal 1, upstream.calls
    assert_equal({ "leader" => 1, "follower" => 49 }, results.map { |_, headers, _| headers["x-debounce"] }.tally)
    assert_equal [[200, "call 1\n"]], results.map { |status, _, body| [status, body] }.uniq
  end

  def test_the_upstream_call_runs_in_a_thread_the_debouncer_owns
    caller = Thread.current
    upstream = Upstream.new { |_env, _n| [200, {}, [Thread.current.equal?(caller) ? "caller" : "owned"]] }

    assert_equal "owned", request(NeverBlock::Debouncer.new(upstream), "/")[2]
  end
end
