# frozen_string_literal: true

module NeverBlock
  class RedisSemaphore
    # The Lua scripts of a {RedisSemaphore}: each runs atomically in Redis,
    # on Redis's clock (TIME), so hosts whose clocks disagree share one.
    #
    # The keys of a semaphore, all in one hash slot ({NAME}):
    #
    #   holders  sorted set: lease token => the Redis time (ms) it ends
    #            (in the rate form: when the acquisition leaves the window)
    #   queue    sorted set: ticket => arrival number (FIFO)
    #   tickets  sorted set: ticket => the Redis time (ms) it is given up
    #            unless its waiter looks again (a dead waiter's place)
    #   seq      counter behind the arrival numbers
    #   ready    the Redis time (ms) from which permits are granted; missing
    #            when Redis lost the semaphore's data (see {INIT})
    #   wake:T   list a releaser pushes to, to wake the waiter of ticket T
    #   gone:T   ticket T was given up (kept one lease): an ask of its that
    #            was still on the way is refused
    #
    # A lease token is its waiter's ticket: one random token per acquire.
    #
    # Who calls them: {RedisSemaphore} only, with KEYS in the order
    # holders, queue, tickets, seq, ready, and ARGV: ticket, limit, hold ms
    # (the lease, or the rate's window), lease ms, the wake:T prefix, the
    # gone:T prefix, and a flag of the script's own.
    module Scripts
      # Redis time in ms, and the expired leases and given-up tickets gone.
      PRELUDE = <<~LUA
        if redis.replicate_commands then redis.replicate_commands() end
        local time = redis.call('TIME')
        local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
        redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
        local gone = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', now, 'LIMIT', 0, 100)
        for _, ticket in ipairs(gone) do
          redis.call('ZREM', KEYS[2], ticket)
          redis.call('ZREM', KEYS[3], ticket)
        end
      LUA

      # Wakes the waiters whose turn it is: the first (limit - holders)
      # tickets (their wake keys last one lease).
      WAKE = <<~LUA
        local function wake()
          local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
          if free <= 0 then return end
          for _, ticket in ipairs(redis.call('ZRANGE', KEYS[2], 0, free - 1)) do
            local key = ARGV[5] .. ticket
            redis.call('LPUSH', key, '1')
            redis.call('PEXPIRE', key, ARGV[4])
          end
        end
      LUA

      # Takes a place in line (once) and a permit when it is this ticket's
      # turn: it is among the first (limit - holders) in line, and the
      # semaphore is ready. The place lasts one lease unless asked again.
      # @return [Array(Integer, Integer)] [1, 0] when taken; [0, ms] when
      #   not (ms: when to look again at the latest without a wake-up: the
      #   first lease or window to end, the end of a fence); [-1, 0] when
      #   the `ready` key is missing (run {INIT}, then this again); [-2, 0]
      #   for a ticket given up.
      ACQUIRE = <<~LUA
        local ready = redis.call('GET', KEYS[5])
        if not ready then return {-1, 0} end
        if redis.call('EXISTS', ARGV[6] .. ARGV[1]) == 1 then return {-2, 0} end
        #{PRELUDE}
        ready = tonumber(ready)
        local ticket = ARGV[1]
        if not redis.call('ZSCORE', KEYS[2], ticket) then
          redis.call('ZADD', KEYS[2], redis.call('INCR', KEYS[4]), ticket)
        end
        local free = tonumber(ARGV[2]) - redis.call('ZCARD', KEYS[1])
        if now >= ready and redis.call('ZRANK', KEYS[2], ticket) < free then
          redis.call('ZREM', KEYS[2], ticket)
          redis.call('ZREM', KEYS[3], ticket)
          redis.call('DEL', ARGV[5] .. ticket)
          redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ticket)
          return {1, 0}
        end
        redis.call('ZADD', KEYS[3], now + tonumber(ARGV[4]), ticket)
        if now < ready then return {0, ready - now} end
        local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
        if first[2] then return {0, tonumber(first[2]) - now} end
        return {0, tonumber(ARGV[4])}
      LUA

      # Gives a ticket's permit back, or, with the flag "gone", its place in
      # line (a waiter that timed out or was cancelled, possibly after Redis
      # granted it a permit it never heard of, or before an ask of its
      # arrived: that ask is refused), and wakes the waiters whose turn it is.
      # @return [Integer] 1.
      RELEASE = <<~LUA
        #{PRELUDE}
        #{WAKE}
        if ARGV[7] == 'gone' then redis.call('SET', ARGV[6] .. ARGV[1], '1', 'PX', ARGV[4]) end
        redis.call('ZREM', KEYS[1], ARGV[1])
        redis.call('ZREM', KEYS[2], ARGV[1])
        redis.call('ZREM', KEYS[3], ARGV[1])
        redis.call('DEL', ARGV[5] .. ARGV[1])
        wake()
        return 1
      LUA

      # Extends a lease by `hold` ms. A lease Redis no longer has is added
      # again only while the semaphore is not ready (Redis lost its data:
      # the holders register again during the fence).
      # @return [Integer] 1 extended, 2 registered again, 0 lost (expired
      #   and perhaps taken by another).
      RENEW = <<~LUA
        local ready = redis.call('GET', KEYS[5])
        #{PRELUDE}
        if redis.call('ZSCORE', KEYS[1], ARGV[1]) then
          redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
          return 1
        end
        if not ready or now < tonumber(ready) then
          redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
          return 2
        end
        return 0
      LUA

      # Marks the semaphore ready from `fence` ms on, unless another did.
      # Run when `ready` is missing: the first use ever, or Redis lost the
      # data (restarted without persistence, flushed); the fence gives the
      # holders that Redis forgot time to register again ({RENEW}).
      # ARGV: the fence in ms.
      INIT = <<~LUA
        local time = redis.call('TIME')
        local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
        redis.call('SET', KEYS[5], now + tonumber(ARGV[1]), 'NX')
        return 1
      LUA

      # @return [Array(Integer, Integer)] live leases (or acquisitions in the
      #   window) and tickets in line, fleet-wide.
      STATS = <<~LUA
        #{PRELUDE}
        return {redis.call('ZCARD', KEYS[1]), redis.call('ZCARD', KEYS[2])}
      LUA
    end
  end
end
