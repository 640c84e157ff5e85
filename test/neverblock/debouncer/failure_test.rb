# frozen_string_literal: true

require_relative "debouncer_helper"

# The upstream call belongs to the debouncer; failures reach every waiter and are never stored.
class DebouncerFailureTest < NeverBlockTest
  include ServerHelper
  include DebouncerHelper
  neverblock_timeout 30

  def test_followers_get_the_answer_when_the_leaders_client_disconnects
    release = false
    store = CountingStore.new(NeverBlock::Debouncer::MemoryStore.new)
    upstream = Upstream.new(hold: -> { release })
    start_server(NeverBlock::Debouncer.new(upstream, store: store))

    leader = connect
    leader.write(get("/report"))
    eventually { upstream.calls == 1 }
    followers = Array.new(5) { connect.tap { |socket| socket.write(get("/report")) } }
    eventually { store.claims == 6 }
    leader.setsockopt(Socket::SOL_SOCKET, Socket::SO_LINGER, [1, 0].pack("ii")) # close with a reset
    leader.close
    release = true

    responses = followers.map { |socket| read_response(socket) }
    assert_equal [[200, "follower", "call 1\n"]], responses.map { |status, headers, body| [status, headers["x-debounce"], body] }.uniq
    assert_equal 1, upstream.calls
  end

  def test_cancelling_the_leaders_request_does_not_abort_the_upstream_call
    release = false
    finished = false
    upstream = Upstream.new(hold: -> { release }) do |_env, n|
      finished = true
      [200, {}, ["call #{n}\n"]]
    end
    debouncer = NeverBlock::Debouncer.new(upstream)

    leader = NeverBlock.spawn { request(debouncer, "/report") }
    followers = Array.new(5) { NeverBlock.spawn { request(debouncer, "/report") } }
    sleep 0.05 until upstream.calls == 1
    leader.cancel
    assert_raises(NeverBlock::Cancelled) { leader.value }
    release = true

    assert_equal [[200, "follower", "call 1\n"]], followers.map(&:value).map { |s, h, b| [s, h["x-debounce"], b] }.uniq
    assert finished, "the upstream call ran to its end"
  end

  def test_killing_the_leaders_thread_does_not_abort_the_upstream_call
    release = false
    upstream = Upstream.new(hold: -> { release })
    debouncer = NeverBlock::Debouncer.new(upstream)

    leader = Thread.new { debouncer.call(rack_env("/report")) }
    sleep 0.01 until upstream.calls == 1
    followers = Array.new(5) { Thread.new { request(debouncer, "/report") } }
    sleep 0.01 until followers.all? { |thread| thread.status == "sleep" }
    leader.kill.join
    release = true

    assert_equal [[200, "follower", "call 1\n"]], followers.map(&:value).map { |s, h, b| [s, h["x-debounce"], b] }.uniq
    assert_equal 1, upstream.calls
  end

  def test_an_app_exception_is_raised_to_the_leader_and_followers_get_502_promptly
    upstream = Upstream.new(delay: 0.1) { |_env, _n| raise ArgumentError, "boom" }
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60, wait_timeout: 10)

    results = nil
    seconds = elapsed do
      results = concurrently(20) do
        request(debouncer, "/report")
      rescue ArgumentError => e
        e
      end
    end

    assert_equal 1, results.count { |result| result.is_a?(ArgumentError) }, "the leader gets the app's exception"
    followers = results.grep(Array)
    assert_equal [[502, "follower"]], followers.map { |status, headers, _| [status, headers["x-debounce"]] }.uniq
    assert_equal 19, followers.size
    assert_operator seconds, :<, 5, "followers do not wait for wait_timeout"
    assert_equal 1, upstream.calls
  end

  def test_a_failure_is_never_stored
    upstream = Upstream.new { |_env, n| n == 1 ? raise("boom") : [200, {}, ["call #{n}\n"]] }
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    assert_raises(RuntimeError) { request(debouncer, "/report") }

    assert_equal [200, "call 2\n"], request(debouncer, "/report").values_at(0, 2)
    assert_equal 0, debouncer.store.in_flight
  end

  def test_over_a_real_server_the_leader_gets_500_and_followers_502
    store = CountingStore.new(NeverBlock::Debouncer::MemoryStore.new)
    upstream = Upstream.new(hold: -> { store.claims >= 4 }) { |_env, _n| raise "upstream down" }
    start_server(NeverBlock::Debouncer.new(upstream, store: store))

    statuses = nil
    capture_log do
      statuses = concurrently(4) do
        socket = TCPSocket.new("127.0.0.1", @port)
        socket.write(get("/report"))
        read_response(socket).first
      ensure
        socket&.close
      end
    end

    assert_equal({ 500 => 1, 502 => 3 }, statuses.tally)
  end

  def test_followers_get_504_after_wait_timeout_and_the_leader_its_response
    upstream = Upstream.new(delay: 1.0)
    debouncer = NeverBlock::Debouncer.new(upstream, wait_timeout: 0.1)

    results = concurrently(5) { request(debouncer, "/slow") }

    assert_equal({ [200, "leader"] => 1, [504, "follower"] => 4 },
                 results.map { |status, headers, _| [status, headers["x-debounce"]] }.tally)
    assert_equal 1, upstream.calls
  end

  def test_on_wait_timeout_pass_sends_followers_upstream_themselves
    upstream = Upstream.new(delay: 0.5)
    debouncer = NeverBlock::Debouncer.new(upstream, wait_timeout: 0.05, on_wait_timeout: :pass)

    results = concurrently(5) { request(debouncer, "/slow") }

    assert_equal [200], results.map(&:first).uniq
    assert_equal 5, upstream.calls
  end
end
