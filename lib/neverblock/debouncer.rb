# frozen_string_literal: true

require_relative "../neverblock"
require_relative "debouncer/key"
require_relative "debouncer/outcome"
require_relative "debouncer/cache_policy"
require_relative "debouncer/memory_store"
require_relative "debouncer/local_first"
require_relative "debouncer/upstream_call"

module NeverBlock
  # A Rack middleware that coalesces a herd of identical requests into one
  # upstream call: the first request (the leader) calls the app, the others
  # (followers) wait for its response and get an exact copy — status, every
  # header and the body — with `x-debounce: leader`, `follower`, `hit`
  # (answered from the store, with `ttl:`) or `stale` (answered from the
  # store past its ttl while one request refreshes it, with
  # `stale_while_revalidate:`).
  #
  #   require "neverblock/debouncer"
  #   use NeverBlock::Debouncer, ttl: 2, wait_timeout: 10
  #
  # It works under any Rack server. The default store coalesces the fibers
  # and threads of one process; {RedisStore} (`require
  # "neverblock/debouncer/redis_store"`) coalesces every process that shares
  # a Redis. A store is a small protocol (see {MemoryStore}), so others fit.
  #
  # == Which requests are coalesced
  #
  # Only `methods` (GET and HEAD by default) without a request body, and,
  # unless `share_credentials: :per_credential`, only requests without
  # `Authorization` and `Cookie`; every other request passes straight
  # through. The key is the method, scheme, host, path, the query with its
  # parameters sorted, the `vary` request headers, the forwarding
  # (`X-Forwarded-Host`, `Forwarded`, ...) and conditional or range
  # (`If-None-Match`, `Range`, ...) request headers and, per credential, a
  # SHA-256 of the credential; see {Key}. When the response has a Vary
  # header, a follower whose values of those headers differ from the
  # leader's does not get the leader's response: it coalesces under its own
  # key instead.
  #
  # == Who owns the upstream call
  #
  # The app runs in a task (inside a NeverBlock loop) or a thread (anywhere
  # else) that belongs to the debouncer; the leader waits for it like a
  # follower. So a leader whose client disconnects, or whose request the
  # server cancels, does not abort the call, and the followers get the
  # answer. What this means for the app:
  # - it sees the leader's env (the same Hash: changes it makes to the env
  #   are visible to the leader's outer middleware, not to the followers');
  #   a stale-while-revalidate refresh sees a copy of the env of the request
  #   that found the response stale, which does not wait for it;
  # - thread- and fiber-locals (`Thread.current[:x]`) set by outer
  #   middleware are not visible inside the app; Fiber storage (`Fiber[:x]`)
  #   is inherited (Ruby >= 3.2); pass per-request state through the env;
  # - `rack.hijack` must not be used behind the debouncer.
  #
  # == Failures
  #
  # When the app raises, the exception is re-raised to the leader (so the
  # server's 500 handling and error reporters see it), the followers get 502
  # at once, and nothing is stored. A follower that has waited
  # `wait_timeout` seconds gets 504 (or, with `on_wait_timeout: :pass`, calls
  # the app itself); the leader waits as long as the app takes. When the
  # store itself fails (Redis unreachable), the error is logged and requests
  # are served without coalescing.
  #
  # == What is shared, what is stored
  #
  # A response is shared with the followers that waited for it unless it
  # has Set-Cookie, `Cache-Control: private` or `Vary: *` (then each
  # follower calls the app itself), or its body is larger than `max_body`
  # (it streams to the leader only, and the followers call the app
  # themselves; a response whose Content-Length is over `max_body` streams
  # from its first byte, one without a Content-Length is buffered until it
  # passes `max_body`). With `ttl` > 0 a shared response also answers identical
  # requests for `ttl` seconds — at most its `max-age`/`s-maxage`, never
  # with `no-store` or `no-cache`, never for a 5xx or other status outside
  # {CachePolicy::STORABLE}. The store keeps at most `max_entries`
  # responses, least recently used out.
  class Debouncer
    # The response header naming the request's role.
    HEADER = "x-debounce"
    # @api private
    ROLE_LEADER = "leader"
    # @api private
    ROLE_FOLLOWER = "follower"
    # @api private
    ROLE_HIT = "hit"
    # @api private
    ROLE_STALE = "stale"

    # Methods that may be coalesced: those that do not change anything.
    SAFE_METHODS = %w[GET HEAD OPTIONS].freeze

    # @return [#claim, #await, #complete, #size] the store.
    attr_reader :store

    # @param app [#call] the Rack app.
    # @param ttl [Numeric] seconds a successful response answers identical
    #   requests after it arrived (default 0: only the requests waiting for it).
    # @param stale_while_revalidate [Numeric] seconds after `ttl` that a
    #   stored response still answers (as `x-debounce: stale`) while one
    #   request refreshes it in the background (default 0: never stale).
    # @param wait_timeout [Numeric] seconds a follower waits (default 10).
    # @param on_wait_timeout [:fail, :pass] `:fail` answers 504, `:pass`
    #   calls the app for the follower.
    # @param methods [Array<String>] methods to coalesce (a subset of
    #   {SAFE_METHODS}); default GET and HEAD.
    # @param vary [Array<String>] request header names always part of the key.
    # @param max_body [Integer] bytes of body shared at most (default 8 MiB).
    # @param max_entries [Integer] responses stored at most (default 10,000).
    # @param share_credentials [false, :per_credential] `false` (default):
    #   requests with Authorization or Cookie are never coalesced;
    #   `:per_credential`: they are, only with requests bearing the same
    #   credentials (a SHA-256 of them is in the key).
    # @param store [:memory, Object] `:memory`, or an object that speaks the
    #   store protocol ({MemoryStore}), like a {RedisStore}; requests of this
    #   process coalesce in memory before one of them asks a store whose
    #   `shared?` is true ({LocalFirst}).
    # @raise [ArgumentError] for an invalid option.
    def initialize(app, ttl: 0, stale_while_revalidate: 0, wait_timeout: 10, on_wait_timeout: :fail,
                   methods: %w[GET HEAD], vary: [], max_body: 8 * 1024 * 1024, max_entries: 10_000,
                   share_credentials: false, store: :memory)
      @app = app
      @ttl = NeverBlock.validate_timeout!(ttl, :ttl)
      @stale = NeverBlock.validate_timeout!(stale_while_revalidate, :stale_while_revalidate)
      @wait_timeout = NeverBlock.validate_timeout!(wait_timeout, :wait_timeout)
      @on_wait_timeout = check_option(on_wait_timeout, %i[fail pass], :on_wait_timeout)
      @methods = methods.map { |name| name.to_s.upcase }.freeze
      unsafe = @methods - SAFE_METHODS
      raise ArgumentError, "methods: #{unsafe.join(', ')} change state and are never coalesced" unless unsafe.empty?

      @max_body = NeverBlock.validate_size!(max_body, :max_body, minimum: 0)
      check_option(share_credentials, [false, :per_credential], :share_credentials)
      @key = Key.new(vary: vary, share_credentials: share_credentials)
      @store = if store == :memory then MemoryStore.new(max_entries: max_entries)
               elsif store.respond_to?(:shared?) && store.shared? then LocalFirst.new(store) # one request per process asks it
               else store
               end
    end

    # @param env [Hash] a Rack env.
    # @return [Array] a Rack response.
    def call(env)
      key = @key.call(env) if coalescible?(env)
      key ? debounce(env, key) : @app.call(env)
    end

    private

    # `varied`: the key already includes the response's Vary headers, so a
    # second mismatch (the upstream changed its Vary) goes straight upstream.
    def debounce(env, key, varied: false)
      role, value, lease = with_store { @store.claim(key) }
      case role
      when nil then @app.call(env) # the store failed: serve the request without it
      when :hit then answer(env, key, value, ROLE_HIT, varied)
      when :stale then revalidate(env, key, value, lease, varied)
      when :leader then lead(env, value)
      else follow(env, key, value, varied)
      end
    end

    def lead(env, lease)
      call = upstream_call(env, lease).start
      message = nil
      begin
        message = call.result
      ensure
        call.abandon unless message # the leader's request was cancelled
      end
      raise message[1] if message[0] == :error

      _, status, headers, body = message
      [status, headers.key?(HEADER) ? headers : headers.merge(HEADER => ROLE_LEADER), body]
    end

    # Answers with the stale response and refreshes it in the background, on
    # a copy of the env: this request goes on without waiting for it.
    def revalidate(env, key, response, lease, varied)
      upstream_call(env.dup, lease).start.abandon
      answer(env, key, response, ROLE_STALE, varied)
    end

    def upstream_call(env, lease)
      UpstreamCall.new(@app, env, @store, lease, ttl: @ttl, stale: @stale, max_body: @max_body)
    end

    # A follower only waits for the leader's answer: under NeverBlock::Server
    # it gives its request slot back first (Server::MARK_AS_IO_BOUND; the
    # debouncer does not load the server), so that a herd's followers do not
    # hold back the rest of the herd, which would otherwise be admitted only
    # after the answer is gone and lead again.
    def follow(env, key, ticket, varied)
      env["neverblock.mark_as_io_bound"]&.call
      outcome = with_store(:failed) { @store.await(ticket, @wait_timeout) }
      case outcome
      when :failed then @app.call(env)
      when nil
        @on_wait_timeout == :pass ? @app.call(env) : wait_timeout_response
      when :retry then debounce(env, key, varied: varied)
      when Outcome::PASS then @app.call(env)
      when Outcome::Failure then outcome.to_rack(ROLE_FOLLOWER)
      else answer(env, key, outcome, ROLE_FOLLOWER, varied)
      end
    end

    def answer(env, key, response, role, varied)
      return response.to_rack(role) if response.matches?(env)
      return @app.call(env) if varied

      debounce(env, @key.varied(key, response.vary.keys, env), varied: true)
    end

    # A shared store that fails (Redis unreachable) must not take the site
    # down: the request is served as if there were no debouncer.
    def with_store(failed = nil)
      yield
    rescue StandardError => e
      NeverBlock.logger.error("NeverBlock::Debouncer: the store failed, serving without it: #{e.class}: #{e.message}")
      failed
    end

    def coalescible?(env)
      @methods.include?(env["REQUEST_METHOD"]) && !body?(env)
    end

    def body?(env)
      env["HTTP_TRANSFER_ENCODING"] || env["CONTENT_LENGTH"].to_i.positive?
    end

    def wait_timeout_response
      Outcome::Failure.new(504, "Gateway Timeout: the upstream call took longer than #{@wait_timeout} s")
                      .to_rack(ROLE_FOLLOWER)
    end

    def check_option(value, allowed, name)
      raise ArgumentError, "#{name} must be one of #{allowed.map(&:inspect).join(', ')}, got #{value.inspect}" unless
        allowed.include?(value)

      value
    end
  end
end
