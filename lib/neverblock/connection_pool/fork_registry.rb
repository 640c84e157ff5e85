# frozen_string_literal: true

require_relative "../fork_hook"

module NeverBlock
  class ConnectionPool
    # The pools that have open connections, strongly held (a pool with open
    # connections is in use, or its connections leak anyway), so that a
    # forked child can make each forget the parent's connections before the
    # child's own code runs. (Not an ObjectSpace::WeakMap: on Ruby 3.1 its
    # iteration can yield pools that are already garbage.)
    #
    # Who calls it: a pool adds itself when it opens its first connection
    # (ConnectionPool#born) and deletes itself when it closes its last
    # (ConnectionPool#take_back_locked, #disconnect_all); {.after_fork} runs
    # in a forked child (ForkHook); {ConnectionPool.active} reads it for
    # status pages.
    #
    # Lock discipline: the Registry has a lock of its own. #add and #delete
    # are called with the pool's lock held, so the order is always pool lock
    # first, then the Registry's; #pools is called without a pool's lock.
    module Registry
      @pools = {}.compare_by_identity
      @lock = Thread::Mutex.new

      class << self
        # @param pool [ConnectionPool]
        def add(pool)
          @lock.synchronize { @pools[pool] = true }
        end

        # @param pool [ConnectionPool]
        def delete(pool)
          @lock.synchronize { @pools.delete(pool) }
        end

        # @return [Array<ConnectionPool>]
        def pools
          @lock.synchronize { @pools.keys }
        end

        # In a forked child (one thread: no lock needed, and the parent's
        # other threads may have held it when they vanished).
        def after_fork
          @lock = Thread::Mutex.new
          @pools.keys.each(&:after_fork)
        end
      end
    end
    private_constant :Registry

    NeverBlock.on_fork_child { Registry.after_fork }

    # The pools of this process that have open connections (what a status
    # page shows; see Server#stats).
    # @return [Array<ConnectionPool>]
    def self.active
      Registry.pools.reject do |pool|
        stats = pool.stats
        (stats[:in_use] + stats[:idle] + stats[:waiting]).zero?
      end
    end

    # A pool's side of forking: in a forked child it forgets the parent's
    # connections, without closing them, and a connection the parent held
    # taken back in the child is ignored.
    #
    # Who calls it: Registry.after_fork runs #after_fork for each pool with
    # open connections as the child starts; any other pool notices the fork
    # when the child first uses it (#detect_fork: at the start of #lend,
    # #stats and #disconnect_all, and through #parents? of each checkin and
    # discard). Mixed into ConnectionPool; works on its @born, @forgotten,
    # @epoch, @forget and @fork_generation (#after_fork runs #reset).
    #
    # Lock discipline: called without the pool's lock (#after_fork replaces
    # it: in the child, the parent's other threads may have held the old
    # one when they vanished).
    module ForkSafety
      # Forgets every connection without closing it: they belong to the
      # parent process, and closing would end the parent's sessions too.
      # Runs by itself in a forked child (forked through Process._fork, see
      # ForkHook) for every pool with open connections, and for any other
      # pool when the child first uses it; taking back a connection the
      # parent held is then a no-op.
      # @return [void]
      def after_fork
        forgotten = @born.keys
        reset
        @epoch += 1
        @forgotten = forgotten.to_h { |connection| [connection, true] }.compare_by_identity
        forgotten.each { |connection| forget_quietly(connection) } if @forget
      end

      private

      # Called without the lock: runs #after_fork once this process turns
      # out to be a child the pool has not yet seen.
      def detect_fork
        after_fork if @fork_generation != NeverBlock.fork_generation
      end

      # Called without the lock: whether `connection` is one the parent
      # process held when it forked.
      def parents?(connection)
        detect_fork
        @forgotten&.key?(connection)
      end

      # A failing `forget:` callable is logged, not raised: the child goes
      # on without that connection either way.
      def forget_quietly(connection)
        @forget.call(connection)
      rescue StandardError => e
        NeverBlock.logger.warn("NeverBlock") { "forgetting a pooled connection after fork failed: #{e.class}: #{e.message}" }
      end
    end
  end
end
