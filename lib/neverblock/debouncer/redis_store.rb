# frozen_string_literal: true

require "json"
require "securerandom"
begin
  require "redis_client"
rescue LoadError => e
  raise LoadError, "NeverBlock::Debouncer::RedisStore needs the redis-client gem: " \
                   "add `gem \"redis-client\"` to your Gemfile (#{e.message})"
end
require_relative "../debouncer"

module NeverBlock
  class Debouncer
    # A store in Redis: coalesces every process that uses the same Redis
    # (and prefix), e.g. all workers of all servers behind a load balancer.
    #
    #   require "neverblock/debouncer/redis_store"
    #   use NeverBlock::Debouncer, ttl: 2,
    #       store: NeverBlock::Debouncer::RedisStore.new(url: "redis://127.0.0.1:6379/0")
    #
    # == How
    #
    # - Leader election per key: `SET lock:KEY TOKEN NX PX lease`. While the
    #   call runs, a background thread extends the lock (every lease / 3);
    #   when the leader's process dies the lock expires after `lease`
    #   seconds, and a waiting follower claims the key and calls upstream.
    # - The outcome is written to `result:KEY:TOKEN` (kept `result_ttl`
    #   seconds, so a follower that looks late still finds it), with `ttl`
    #   also to `value:KEY` (kept ttl + stale-while-revalidate seconds) and
    #   `fresh:KEY` (kept ttl seconds), then announced on the channel
    #   `done:KEY`. A value without its fresh key is stale: the request that
    #   takes the lock refreshes it, the others get it as it is. One
    #   pattern subscription per store wakes the local followers, which read
    #   the result; they also look every `poll_interval` seconds, so a lost
    #   message costs latency, not correctness.
    # - Every key expires, and keys are SHA-256 digests ({Key}): Redis never
    #   holds a URL or a credential in a key. Bodies are stored base64 in JSON.
    #   Bound Redis's memory with its own `maxmemory` and an LRU policy
    #   (`max_entries` applies to {MemoryStore} only).
    #
    # Redis is reached with redis-client's pool; under NeverBlock its socket
    # waits suspend only the calling fiber. If Redis fails, the debouncer
    # logs it and serves requests without coalescing.
    #
    # Call {#close} when done (it stops the background thread and closes
    # the connections).
    class RedisStore
      # The lease of a leader: its key and the token in its lock.
      Lease = Struct.new(:key, :token)
      # What a follower waits on: the key and the leader's token.
      Ticket = Struct.new(:key, :token)
      # Local followers of one key: woken when its channel announces a result.
      Waiting = Struct.new(:condition, :count, :version)

      # Extends a lock only while it is still this leader's.
      EXTEND = "if redis.call('GET', KEYS[1]) == ARGV[1] then " \
               "return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
      # Deletes a lock only while it is still this leader's.
      RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

      # @param url [String] `redis://host:port/db`, `unix:///path/redis.sock`.
      # @param prefix [String] of every key and channel.
      # @param lease [Numeric] seconds a dead leader's lock lives (default 5).
      # @param poll_interval [Numeric] seconds between a follower's own looks (default 0.5).
      # @param result_ttl [Numeric] seconds an outcome stays readable for followers (default 60).
      # @param pool_size [Integer] Redis connections at most, besides the subscriber's.
      # @param redis_timeout [Numeric] seconds to connect, read and write, and to wait for a pooled connection.
      def initialize(url: "redis://127.0.0.1:6379", prefix: "neverblock:debouncer:", lease: 5, poll_interval: 0.5,
                     result_ttl: 60, pool_size: 16, redis_timeout: 5)
        @redis_timeout = NeverBlock.validate_timeout!(redis_timeout, :redis_timeout)
        # One retry on a connection error: after Redis restarts, every pooled
        # connection is dead and would otherwise fail one request each (served
        # uncoalesced). Every command here is safe to repeat (MGET, SET NX with
        # a random token, the token-checked scripts, SETs of the same value).
        @config = RedisClient.config(url: url, timeout: @redis_timeout, reconnect_attempts: 1)
        @redis = @config.new_pool(size: NeverBlock.validate_size!(pool_size, :pool_size), timeout: redis_timeout)
        @prefix = prefix
        @lease_ms = milliseconds(lease, :lease)
        @result_ttl_ms = milliseconds(result_ttl, :result_ttl)
        @poll_interval = NeverBlock.validate_timeout!(poll_interval, :poll_interval)
        @mutex = Thread::Mutex.new
        @waiting = {}
        @held = {}
        @listener = nil
        @closed = false
      end

      # @param key [String]
      # @return [Array(Symbol, Object)] `[:hit, response]`, `[:stale,
      #   response, Lease]`, `[:leader, Lease]` or `[:follower, Ticket]` (see
      #   the protocol in {MemoryStore}).
      def claim(key)
        loop do
          value, fresh, holder = @redis.call("MGET", value_key(key), fresh_key(key), lock_key(key))
          return [:hit, decode(value)] if value && (fresh || holder)
          return [:follower, Ticket.new(key, holder)] if holder

          lease = lock(key) or next
          return value ? [:stale, decode(value), lease] : [:leader, lease]
        end
      end

      # @param ticket [Ticket]
      # @param timeout [Numeric] seconds.
      # @return [Outcome::Response, Outcome::Failure, Symbol, nil] the outcome;
      #   `:retry` when the leader's lock expired without one; nil on timeout.
      def await(ticket, timeout)
        listen
        deadline = Clock.now + timeout
        waiting = register(ticket.key)
        loop do
          version = @mutex.synchronize { waiting.version }
          result, holder = @redis.call("MGET", result_key(ticket.key, ticket.token), lock_key(ticket.key))
          return decode(result) if result
          return :retry unless holder == ticket.token

          remaining = deadline - Clock.now
          return nil if remaining <= 0

          @mutex.synchronize do
            waiting.condition.wait(@mutex, [remaining, @poll_interval].min) if waiting.version == version
          end
        end
      ensure
        unregister(ticket.key) if waiting
      end

      # @param lease [Lease]
      # @param outcome [Outcome::Response, Outcome::Failure, Symbol]
      # @param ttl [Numeric] seconds to store a response; 0 stores nothing.
      # @param stale [Numeric] seconds after `ttl` to serve it stale.
      # @return [void]
      def complete(lease, outcome, ttl, stale = 0)
        @mutex.synchronize { @held.delete(lease) }
        encoded = encode(outcome)
        @redis.pipelined do |pipeline|
          pipeline.call("SET", result_key(lease.key, lease.token), encoded, "PX", @result_ttl_ms)
          if ttl.positive? && outcome.is_a?(Outcome::Response)
            # The value outlives its freshness marker by the stale window.
            pipeline.call("SET", value_key(lease.key), encoded, "PX", milliseconds(ttl + stale, :ttl))
            pipeline.call("SET", fresh_key(lease.key), "1", "PX", milliseconds(ttl, :ttl))
          end
          pipeline.call("EVAL", RELEASE, 1, lock_key(lease.key), lease.token)
          pipeline.call("PUBLISH", channel(lease.key), lease.token)
        end
      end

      # Shared by processes: a {Debouncer} coalesces its own requests in
      # memory first, so one request per process talks to Redis ({LocalFirst}).
      # @return [true]
      def shared?
        true
      end

      # @return [Integer] stored responses (a SCAN: for tests and diagnostics).
      def size
        count("value:*")
      end

      # @return [Integer] leader locks held, in every process (a SCAN).
      def in_flight
        count("lock:*")
      end

      # Stops the background thread and closes every connection.
      # @return [void]
      def close
        @closed = true
        # The listener looks at @closed at least every poll_interval; the
        # bounded join is a safety net, never the normal path.
        if @listener && !@listener.join(@poll_interval + @redis_timeout)
          NeverBlock.logger.warn("NeverBlock::Debouncer::RedisStore: the listener thread did not stop; killing it")
          @listener.kill
        end
        @redis.close
      end

      private

      # @return [Lease, nil] the lock on `key`, or nil when another took it.
      def lock(key)
        token = SecureRandom.hex(16)
        return nil unless @redis.call("SET", lock_key(key), token, "NX", "PX", @lease_ms)

        listen
        lease = Lease.new(key, token)
        @mutex.synchronize { @held[lease] = true }
        lease
      end

      # Starts, once, the thread that receives the `done:*` announcements
      # and extends the locks this process holds. It is subscribed when
      # this returns.
      def listen
        return if @listener

        @mutex.synchronize do
          return if @listener

          pubsub = subscribe
          @listener = Thread.new { listen_loop(pubsub) }
          @listener.report_on_exception = false
        end
      end

      # @return [RedisClient::PubSub] subscribed to this store's announcements.
      def subscribe
        pubsub = @config.new_client.pubsub
        pubsub.call("PSUBSCRIBE", "#{@prefix}done:*")
        pubsub.next_event(@redis_timeout) # the subscription's confirmation
        pubsub
      rescue StandardError
        pubsub&.close
        raise
      end

      # The listener thread's life: announcements wake local followers, and
      # the leases this process holds are extended every lease / 3 seconds,
      # whatever happens to the subscription. A lost subscription (Redis
      # restarted, the network dropped) is logged once, and re-made every
      # tick until Redis answers again; followers are woken meanwhile, as
      # announcements may have been missed (they look for themselves).
      def listen_loop(pubsub)
        tick = [@poll_interval, @lease_ms / 3000.0].min
        extended_at = Clock.now
        until @closed
          pubsub = listen_once(pubsub, tick)
          next if Clock.now - extended_at < @lease_ms / 3000.0

          extended_at = Clock.now
          extend_leases
        end
      ensure
        pubsub&.close
      end

      # @return [RedisClient::PubSub, nil] the subscription, nil while lost.
      def listen_once(pubsub, tick)
        unless pubsub
          sleep(tick)
          return nil if @closed

          pubsub = subscribe
          NeverBlock.logger.warn("NeverBlock::Debouncer::RedisStore: subscribed again to #{@prefix}done:*")
        end
        event = pubsub.next_event(tick)
        announce(event[2].delete_prefix("#{@prefix}done:")) if event && event[0] == "pmessage"
        pubsub
      rescue RedisClient::Error, SystemCallError, IOError => e
        if pubsub
          NeverBlock.logger.warn("NeverBlock::Debouncer::RedisStore lost its subscription (#{e.class}: #{e.message}); " \
                                 "re-subscribing every #{tick} s, leases are still extended")
          pubsub.close
          announce_all
        end
        nil
      end

      def announce_all
        @mutex.synchronize do
          @waiting.each_value do |waiting|
            waiting.version += 1
            waiting.condition.broadcast
          end
        end
      end

      def announce(key)
        @mutex.synchronize do
          waiting = @waiting[key] or return
          waiting.version += 1
          waiting.condition.broadcast
        end
      end

      def extend_leases
        leases = @mutex.synchronize { @held.keys }
        leases.each { |lease| @redis.call("EVAL", EXTEND, 1, lock_key(lease.key), lease.token, @lease_ms) }
      rescue RedisClient::Error => e
        NeverBlock.logger.warn("NeverBlock::Debouncer::RedisStore could not extend its leases: #{e.message}")
      end

      def register(key)
        @mutex.synchronize do
          waiting = (@waiting[key] ||= Waiting.new(Thread::ConditionVariable.new, 0, 0))
          waiting.count += 1
          waiting
        end
      end

      def unregister(key)
        @mutex.synchronize do
          waiting = @waiting[key]
          @waiting.delete(key) if (waiting.count -= 1).zero?
        end
      end

      def encode(outcome)
        JSON.generate(
          case outcome
          when Outcome::Response
            { "type" => "response", "status" => outcome.status, "headers" => outcome.headers,
              "body" => [outcome.body].pack("m0"), "vary" => outcome.vary }
          when Outcome::Failure then { "type" => "failure", "status" => outcome.status, "message" => outcome.message.chomp }
          else { "type" => "pass" }
          end
        )
      end

      def decode(encoded)
        data = JSON.parse(encoded)
        case data["type"]
        when "response"
          Outcome::Response.new(data["status"], data["headers"], data["body"].unpack1("m0"), vary: data["vary"])
        when "failure" then Outcome::Failure.new(data["status"], data["message"])
        else Outcome::PASS
        end
      end

      def count(pattern)
        @redis.with { |redis| redis.scan("MATCH", "#{@prefix}#{pattern}", "COUNT", 1000).count }
      end

      def lock_key(key) = "#{@prefix}lock:#{key}"
      def value_key(key) = "#{@prefix}value:#{key}"
      def fresh_key(key) = "#{@prefix}fresh:#{key}"
      def result_key(key, token) = "#{@prefix}result:#{key}:#{token}"
      def channel(key) = "#{@prefix}done:#{key}"

      def milliseconds(seconds, name)
        (NeverBlock.validate_timeout!(seconds, name) * 1000).ceil.clamp(1..)
      end
    end
  end
end
