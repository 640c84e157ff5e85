# frozen_string_literal: true

module NeverBlock
  class RedisSemaphore
    # The thread that keeps a process's leases alive: every `interval`
    # seconds (a third of the lease) it renews each lease this process holds,
    # on a Redis connection of its own (a busy pool never delays it). It runs
    # only while the process holds a lease, and starts again in a forked
    # child that takes one.
    #
    # Who calls it: RedisSemaphore#hold adds a lease as its block starts and
    # deletes it as the block ends; RedisSemaphore#renew does the renewing.
    # A renewal that fails (Redis down, or a refusal such as LOADING or
    # BUSY) is logged once and tried again on the next turn. A lease Redis
    # no longer has (Redis was down longer than the lease) is logged: the
    # block goes on, and the fleet may run one more holder than the limit
    # until it ends.
    class Renewer
      # @param semaphore [RedisSemaphore]
      # @param interval [Float] seconds between renewals.
      # @param config [RedisClient::Config]
      def initialize(semaphore, interval, config)
        @semaphore = semaphore
        @interval = interval
        @config = config
        after_fork
      end

      # @param token [String] a lease just granted.
      # @return [void]
      def add(token)
        @mutex.synchronize do
          @tokens[token] = true
          start unless @running && @thread&.alive? # (alive: not a thread of the parent, after a fork no hook saw)
        end
      end

      # @param token [String]
      # @return [void]
      def delete(token)
        @mutex.synchronize { @tokens.delete(token) }
      end

      # Stops the thread (the leases still held end with their lease).
      # @return [void]
      def stop
        thread = @mutex.synchronize do
          @stopped = true
          @wake.signal
          @thread
        end
        thread&.join
      end

      # In a forked child: the parent's leases are the parent's to renew.
      # @return [void]
      def after_fork
        @mutex = Thread::Mutex.new
        @wake = Thread::ConditionVariable.new
        @tokens = {}
        @thread = nil
        @running = false # a thread renews (false once it decided to end: it may still be alive)
        @stopped = false
      end

      private

      # Holding @mutex (the thread waits for it before it looks at @running).
      def start
        @thread = Thread.new { run }
        @running = true
        @thread.name = "neverblock-semaphore-renewer"
        @thread.report_on_exception = false
      end

      def run
        redis = @config.new_client
        failing = false
        loop do
          tokens = @mutex.synchronize do
            @wake.wait(@mutex, @interval) unless @stopped
            if @stopped || @tokens.empty? # a new lease starts another thread
              @running = false
              return
            end

            @tokens.keys
          end
          begin
            lost = @semaphore.renew(tokens, redis)
            failing = false
          rescue StandardError => e # Redis down, or a reply such as LOADING or BUSY: tried again next turn
            log_failure(e) unless failing
            failing = true
            next
          end
          # A lease given back while it was being renewed is not lost: its
          # holder deletes it here before it gives it back.
          lost.each do |token|
            next unless @mutex.synchronize { @tokens.delete(token) }

            NeverBlock.logger.warn("NeverBlock::RedisSemaphore #{@semaphore.name}: a lease held here ended before its " \
                                   "block did (Redis was unreachable for longer than the lease); another may hold it now")
          end
        end
      ensure
        redis&.close
        @mutex.synchronize { @running = false if @thread.equal?(Thread.current) } # ended by an exception
      end

      def log_failure(error)
        message = if error.is_a?(SemaphoreUnavailable)
                    "NeverBlock::RedisSemaphore: #{error.message}: leases not renewed"
                  else
                    "NeverBlock::RedisSemaphore #{@semaphore.name}: leases not renewed: #{error.class}: #{error.message}"
                  end
        NeverBlock.logger.warn(message)
      end
    end
  end
end
