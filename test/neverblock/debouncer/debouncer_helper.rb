# frozen_string_literal: true

require_relative "../server/server_helper"
require "neverblock/debouncer"
require "delegate"

# Helpers for the debouncer's tests: an upstream Rack app that counts its
# calls, a store that counts claims, and plain Rack envs.
module DebouncerHelper
  # An upstream app that counts its calls. Each call waits until `hold`
  # (if given) returns true, or `delay` seconds, then returns what the
  # block returns (default: 200 with the call's number in the body).
  class Upstream
    def initialize(delay: 0, hold: nil, &respond)
      @delay = delay
      @hold = hold
      @respond = respond || ->(_env, n) { [200, { "content-type" => "text/plain", "x-call" => n.to_s }, ["call #{n}\n"]] }
      @mutex = Thread::Mutex.new
      @calls = 0
    end

    def call(env)
      n = @mutex.synchronize { @calls += 1 }
      if @hold
        deadline = NeverBlock::Clock.now + 30
        sleep 0.005 until @hold.call || NeverBlock::Clock.now > deadline
      end
      sleep @delay if @delay.positive?
      @respond.call(env, n)
    end

    # @return [Integer] calls so far.
    def calls
      @mutex.synchronize { @calls }
    end
  end

  # A store that counts its claims, so an upstream can wait until every
  # request of a herd has claimed its key (and so is a follower) instead of
  # guessing with sleep.
  class CountingStore < SimpleDelegator
    def initialize(store)
      super
      @mutex = Thread::Mutex.new
      @claims = 0
    end

    def claims
      @mutex.synchronize { @claims }
    end

    def claim(key)
      __getobj__.claim(key).tap { @mutex.synchronize { @claims += 1 } }
    end
  end

  # A Rack env for a GET of `target` (path and query) on example.test.
  def rack_env(target = "/", method: "GET", headers: {})
    path, query = target.split("?", 2)
    env = { "REQUEST_METHOD" => method, "SCRIPT_NAME" => "", "PATH_INFO" => path, "QUERY_STRING" => query.to_s,
            "SERVER_NAME" => "example.test", "SERVER_PORT" => "80", "SERVER_PROTOCOL" => "HTTP/1.1",
            "HTTP_HOST" => "example.test", "rack.url_scheme" => "http", "rack.input" => StringIO.new("") }
    headers.each { |name, value| env[NeverBlock::Debouncer::Key.env_name(name)] = value }
    env
  end

  # Calls the middleware and returns [status, headers, body String].
  def request(app, target = "/", **options)
    status, headers, body = app.call(rack_env(target, **options))
    text = +""
    body.each { |chunk| text << chunk }
    body.close if body.respond_to?(:close)
    [status, headers, text]
  end

  # Runs `count` requests at once (fibers inside NeverBlock, threads outside),
  # each given its index; returns their results in order.
  def concurrently(count, &block)
    if NeverBlock.neverblocking?
      NeverBlock.map(0...count, concurrency: count, &block)
    else
      Array.new(count) { |i| Thread.new { block.call(i) } }.map(&:value)
    end
  end
end
