# frozen_string_literal: true

require_relative "debouncer_helper"

# No response is ever shared between different credentials.
class DebouncerCredentialsTest < NeverBlockTest
  include DebouncerHelper

  # The upstream answers with whose credential it saw.
  def upstream
    @upstream ||= Upstream.new(delay: 0.1) do |env, n|
      [200, {}, ["#{env['HTTP_AUTHORIZATION'] || env['HTTP_COOKIE']} #{n}"]]
    end
  end

  def test_credentialed_requests_are_not_coalesced_by_default
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60)

    results = concurrently(6) do |i|
      request(debouncer, "/me", headers: i.even? ? { "Authorization" => "Bearer alice" } : { "Cookie" => "s=alice" })
    end

    assert_equal 6, upstream.calls
    assert(results.none? { |_, headers, _| headers.key?("x-debounce") })
    assert_equal 0, debouncer.store.size
  end

  def test_per_credential_coalesces_each_credential_separately
    debouncer = NeverBlock::Debouncer.new(upstream, share_credentials: :per_credential)
    tokens = ["Bearer alice", "Bearer bob"]

    results = concurrently(20) { |i| [tokens[i % 2], request(debouncer, "/me", headers: { "Authorization" => tokens[i % 2] })] }

    assert_equal 2, upstream.calls
    results.each { |token, (_, _, body)| assert_equal token, body[0, token.size], "#{token} got #{body}" }
  end

  def test_per_credential_never_answers_another_credential_from_the_store
    debouncer = NeverBlock::Debouncer.new(upstream, ttl: 60, share_credentials: :per_credential)

    alice = request(debouncer, "/me", headers: { "Cookie" => "s=alice" })
    bob = request(debouncer, "/me", headers: { "Cookie" => "s=bob" })
    anonymous = request(debouncer, "/me")

    assert_equal ["s=alice 1", "s=bob 2", " 3"], [alice, bob, anonymous].map(&:last)
    assert_equal "hit", request(debouncer, "/me", headers: { "Cookie" => "s=alice" })[1]["x-debounce"]
  end

  def test_keys_hold_a_digest_of_the_credential_never_the_credential
    key = NeverBlock::Debouncer::Key.new(share_credentials: :per_credential)
    secret = "Bearer very-secret-token"

    with = key.call(rack_env("/me", headers: { "Authorization" => secret }))
    without = key.call(rack_env("/me"))

    refute_equal with, without
    refute_includes with, "very-secret-token"
    assert_match(/\A\h{64}\z/, with)
    assert_nil NeverBlock::Debouncer::Key.new.call(rack_env("/me", headers: { "Authorization" => secret }))
  end
end
