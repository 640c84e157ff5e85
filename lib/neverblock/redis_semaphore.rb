# frozen_string_literal: true

require "securerandom"
begin
  require "redis_client"
rescue LoadError => e
  raise LoadError, "NeverBlock::RedisSemaphore needs the redis-client gem: " \
                   "add `gem \"redis-client\"` to your Gemfile (#{e.message})"
end
require "neverblock"
require_relative "redis_semaphore/scripts"
require_relative "redis_semaphore/renewer"

module NeverBlock
  # A counting semaphore shared through Redis by every process that uses the
  # same Redis and name: at most `limit` holders at once across a fleet of
  # servers, or, with `per:`, at most `limit` acquisitions in any `per`
  # seconds (a sliding window).
  #
  #   require "neverblock/redis_semaphore"
  #   SEARCH = NeverBlock::RedisSemaphore.new("search", 20, url: ENV.fetch("REDIS_URL"))
  #   SEARCH.acquire(timeout: 5) { search_api.query(q) }
  #   GEOCODE = NeverBlock::RedisSemaphore.new("geocode", 600, per: 60, url: ENV.fetch("REDIS_URL"))
  #
  # == How
  #
  # - A holder has a lease in Redis that ends `lease` seconds after it was
  #   last renewed; a thread of the holder's process renews it every
  #   lease / 3 seconds while the block runs. A holder killed with SIGKILL
  #   stops renewing, and its permit comes back within `lease` seconds.
  # - Waiters queue in Redis in arrival order, first come first served
  #   across the fleet: a permit goes to the first in line. The waiters of
  #   one process queue in memory first, so one of them at a time is in
  #   Redis's line. A permit given back wakes the next in line at once (a
  #   BLPOP on a key of its own); a permit whose holder died is found when
  #   its lease ends. A waiter's place lasts `lease` seconds unless it looks
  #   again (it does, every lease / 3): a dead waiter holds no one up for long.
  # - A waiter that times out or is cancelled gives up its place, and gives
  #   back a permit Redis granted it just then; an ask of its still on the
  #   way to Redis is refused when it arrives: no permit is lost.
  # - Time is Redis's (TIME, in the scripts): hosts' clocks do not matter.
  #
  # == When Redis is down
  #
  # By default the semaphore fails closed: {#acquire} raises
  # {SemaphoreUnavailable} when Redis does not answer within
  # `redis_timeout` seconds, and the block does not run. `unavailable: :run`
  # runs the block without a permit instead (logged once per outage),
  # which keeps the app up but does not bound the upstream meanwhile.
  # Holders already running go on; their leases are renewed once Redis
  # answers again.
  #
  # Redis that comes back without the data (restarted without persistence,
  # flushed) grants no permit until `lease` seconds (`per` in the rate form)
  # after it started, so that the holders it forgot register again first;
  # the fence is the part of that time still to run when the semaphore is
  # first used after the restart (none on a Redis up for longer); in the
  # lease form at least a third of the lease plus twice `redis_timeout`
  # (the time a holder takes to register again once Redis answers), which
  # may be longer than a lease. Redis tells its uptime in whole seconds, so
  # the fence may last up to a second longer.
  class RedisSemaphore
    # What `unavailable:` accepts.
    UNAVAILABLE = %i[raise run].freeze

    # Redis errors that mean it cannot answer now (as opposed to a bug).
    DOWN = [RedisClient::ConnectionError].freeze

    # @return [String]
    attr_reader :name

    # @return [Integer] holders at once, or acquisitions per window.
    attr_reader :limit

    # @return [Numeric, nil] the window in seconds of the rate form.
    attr_reader :per

    # @param name [String] the semaphore's name in Redis (with `prefix`).
    # @param limit [Integer] >= 1: holders at once, or with `per:`
    #   acquisitions per window. Every process must use the same.
    # @param url [String] `redis://host:port/db`, `rediss://`, `unix:///path`.
    # @param per [Numeric, nil] seconds: the rate form, at most `limit`
    #   acquisitions in any `per` seconds. A permit is not given back when
    #   the block ends; it leaves the window.
    # @param lease [Numeric] seconds a dead holder's permit (and a dead
    #   waiter's place in line) lasts (default 10).
    # @param prefix [String] of every key.
    # @param redis_timeout [Numeric] seconds to connect, read and write
    #   (default 1): how long {#acquire} takes to fail while Redis is down.
    # @param pool_size [Integer] Redis connections at most per process,
    #   besides one for the waiter at the head of the process's line and one
    #   for renewing leases.
    # @param unavailable [Symbol] `:raise` (fail closed, the default) or
    #   `:run` (run the block without a permit while Redis is down).
    def initialize(name, limit, url: "redis://127.0.0.1:6379", per: nil, lease: 10, prefix: "neverblock:semaphore:",
                   redis_timeout: 1, pool_size: 8, unavailable: :raise)
      raise ArgumentError, "name must be a non-empty String, got #{name.inspect}" unless name.is_a?(String) && !name.empty?
      unless UNAVAILABLE.include?(unavailable)
        raise ArgumentError, "unavailable must be one of #{UNAVAILABLE.map(&:inspect).join(', ')}, got #{unavailable.inspect}"
      end

      @name = name
      @limit = NeverBlock.validate_size!(limit, :limit)
      @per = per && positive!(per, :per)
      @lease_ms = milliseconds(positive!(lease, :lease))
      @hold_ms = @per ? milliseconds(@per) : @lease_ms
      @unavailable = unavailable
      @redis_timeout = NeverBlock.validate_timeout!(redis_timeout, :redis_timeout)
      @config = RedisClient.config(url: url, timeout: @redis_timeout, reconnect_attempts: 1)
      @redis = @config.new_pool(size: NeverBlock.validate_size!(pool_size, :pool_size), timeout: @redis_timeout)
      base = "#{prefix}{#{name}}:"
      @keys = %w[holders queue tickets seq ready].map { |key| base + key }
      @wake_prefix = "#{base}wake:"
      @gone_prefix = "#{base}gone:"
      @renewer = @per ? nil : Renewer.new(self, @lease_ms / 3000.0, @config)
      after_fork
    end

    # Waits for a permit (first come, first served across every process),
    # runs the block holding it, and gives it back however the block ends
    # (the rate form keeps it in the window).
    #
    # @param timeout [Numeric, nil] seconds to wait for a permit at most
    #   (nil: no limit); the block's own time is not limited.
    # @return [Object] the block's value.
    # @raise [SemaphoreTimeout] when no permit came within `timeout`.
    # @raise [SemaphoreUnavailable] when Redis does not answer (unless
    #   `unavailable: :run`); the block has not run.
    def acquire(timeout: nil)
      raise ArgumentError, "RedisSemaphore#acquire needs a block" unless block_given?

      after_fork if @fork_generation != NeverBlock.fork_generation
      ticket = SecureRandom.hex(16)
      begin
        wait_for_permit(ticket, timeout)
      rescue SemaphoreUnavailable => e
        # Not asking Redis to take the place back, which would only double
        # the wait: the place (or a permit granted unheard) ends with its lease.
        return run_unbounded(e) { yield } if @unavailable == :run

        raise SemaphoreUnavailable, "#{e.message}; the block did not run (it fails closed; unavailable: :run " \
                                    "runs it without a permit)", cause: e.cause
      rescue Exception # rubocop:disable Lint/RescueException -- the place is given up however the wait ends
        give_up(ticket)
        raise
      end
      hold(ticket) { yield }
    end

    # @return [Integer] permits free now, fleet-wide (the rate form: left
    #   in the current window).
    # @raise [SemaphoreUnavailable] when Redis does not answer.
    def available
      [@limit - stats[0], 0].max
    end

    # @return [Integer] waiters in Redis's line, fleet-wide (one per
    #   waiting process, see {RedisSemaphore}).
    # @raise [SemaphoreUnavailable] when Redis does not answer.
    def waiting
      stats[1]
    end

    # Stops the renewing thread and closes the connections. Permits held
    # in this process end with their leases.
    # @return [void]
    def close
      @renewer&.stop
      @blocking&.close
      @redis.close
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} #{@name} #{form}>"
    end

    # @api private
    # Renews leases this process holds (the Renewer's thread).
    # @param tokens [Array<String>]
    # @param redis [RedisClient] the Renewer's own connection.
    # @return [Array<String>] the tokens whose lease was lost.
    # @raise [SemaphoreUnavailable] when Redis does not answer.
    def renew(tokens, redis)
      tokens.reject { |token| script(Scripts::RENEW, token, redis: redis).positive? }
    end

    private

    # Holding a place in this process's line, then in Redis's, until a
    # permit is granted.
    def wait_for_permit(ticket, timeout)
      return @line.synchronize { take_turn(ticket) } if timeout.nil?

      NeverBlock.validate_timeout!(timeout, :timeout)
      begin
        NeverBlock.timeout(timeout) { @line.synchronize { take_turn(ticket) } }
      rescue TimeoutError
        raise SemaphoreTimeout, "no permit of #{@name} (RedisSemaphore, #{form}) came within #{timeout} s"
      end
    end

    # The head of this process's line: asks Redis until it grants the
    # permit, waiting between asks on this ticket's wake key.
    def take_turn(ticket)
      loop do
        granted, wait_ms = script(Scripts::ACQUIRE, ticket)
        case granted
        when 1 then return
        when -1 then fence # and ask again
        when -2 then raise BaseError, "RedisSemaphore #{@name}: a ticket still waiting was given up" # a bug
        end
        wait = [wait_ms, @lease_ms / 3].min.clamp(1..) / 1000.0
        answering { blocking.blocking_call(wait + @redis_timeout, "BLPOP", @wake_prefix + ticket, wait) }
      end
    end

    # Redis has no `ready` key: it is new, or lost its data. The fence is
    # what remains of one hold (lease or window) since Redis started.
    # Redis's uptime is the difference of two whole-second clocks, so it
    # says 1 s a few ms after a start: counted a second short, the fence
    # never ends before a whole hold has passed since the start. A fence
    # at all lasts at least the time a holder takes to register again once
    # Redis answers (a renewal's interval and a call that timed out while
    # Redis was coming up; see #register_again_ms): a Redis that answered
    # late after its start (a loaded machine) had left the holders less
    # than that.
    def fence
      uptime_s = redis_uptime_s
      fence_ms = [@hold_ms - ([uptime_s - 1, 0].max * 1000), 0].max
      fence_ms = [fence_ms, register_again_ms].max if fence_ms.positive?
      NeverBlock.logger.warn("NeverBlock::RedisSemaphore #{@name}: Redis started #{uptime_s} s ago without this semaphore's " \
                             "data; no permit for #{fence_ms} ms, while its holders register again") if fence_ms.positive?
      answering { @redis.call("EVAL", Scripts::INIT, @keys.size, *@keys, fence_ms) }
    end

    # @return [Integer] ms a holder takes at most to register again with a
    # Redis that answers: one renewal interval, and one call that timed out
    # just before (its connect and its one reconnect, `redis_timeout` each).
    # The rate form keeps no lease: none.
    def register_again_ms
      @renewer ? (@lease_ms / 3) + (2 * milliseconds(@redis_timeout)) : 0
    end

    # @return [Integer] seconds since Redis started; 0 when it does not
    # say (INFO refused), which fences a whole hold.
    def redis_uptime_s
      Integer(answering { @redis.call("INFO", "server") }[/^uptime_in_seconds:(\d+)/, 1] || 0)
    rescue RedisClient::CommandError
      0
    end

    def hold(ticket)
      @renewer&.add(ticket)
      yield
    ensure
      if @renewer
        @renewer.delete(ticket)
        give_back(ticket)
      end
    end

    def give_back(ticket)
      script(Scripts::RELEASE, ticket, "back")
    rescue SemaphoreUnavailable => e
      NeverBlock.logger.warn("NeverBlock::RedisSemaphore: #{e.message}: a permit was not given back; " \
                             "it ends with its lease, in #{@lease_ms / 1000.0} s")
    end

    # A waiter leaves: its place, or a permit Redis granted it unheard.
    def give_up(ticket)
      script(Scripts::RELEASE, ticket, "gone")
    rescue SemaphoreUnavailable
      nil # its place and permit end with Redis's data, or after `lease`
    end

    def run_unbounded(error)
      unless @unbounded_logged
        @unbounded_logged = true
        NeverBlock.logger.warn("NeverBlock::RedisSemaphore: #{error.message}; running blocks without a permit " \
                               "(unavailable: :run) until it answers")
      end
      yield
    end

    # @return [Object] the script's reply.
    # @raise [SemaphoreUnavailable] when Redis does not answer.
    def script(source, ticket, flag = "", redis: @redis)
      reply = answering do
        redis.call("EVAL", source, @keys.size, *@keys, ticket, @limit, @hold_ms, @lease_ms, @wake_prefix, @gone_prefix, flag)
      end
      @unbounded_logged = false
      reply
    end

    # Runs a Redis call; Redis not answering becomes SemaphoreUnavailable.
    def answering
      yield
    rescue *DOWN => e
      raise SemaphoreUnavailable, "Redis did not answer for the semaphore #{@name} within #{@redis_timeout} s " \
                                  "(#{e.class}: #{e.message})"
    end

    def stats
      script(Scripts::STATS, "")
    end

    def form
      @per ? "#{@limit} per #{@per} s" : "limit #{@limit}"
    end

    # The connection the head of this process's line blocks on (BLPOP).
    def blocking
      @blocking ||= @config.new_client
    end

    # In a forked child (and at start): a line of its own, no leases.
    def after_fork
      @fork_generation = NeverBlock.fork_generation
      @line = Thread::Mutex.new
      @blocking = nil # redis-client reconnects in the child
      @renewer&.after_fork
    end

    def positive!(seconds, name)
      NeverBlock.validate_timeout!(seconds, name)
      raise ArgumentError, "#{name} must be > 0 seconds, got #{seconds.inspect}" unless seconds.positive?

      seconds
    end

    def milliseconds(seconds)
      (seconds * 1000).ceil
    end
  end
end
