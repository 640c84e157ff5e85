# frozen_string_literal: true

require "tmpdir"
require_relative "server_semaphore/slot_file"

module NeverBlock
  # A counting semaphore shared by every process of this machine that opens
  # the same name: at most `limit` holders at once across all the workers
  # of a server, through worker restarts, reforks and hot restarts (the old
  # and the new generation share it while they overlap).
  #
  #   STRIPE = NeverBlock::ServerSemaphore.new("stripe", 3) # 3 calls at once on this machine
  #   STRIPE.acquire(timeout: 5) { Stripe::Charge.retrieve(id) }
  #
  # Create it at app load (or lazily: processes that open the name later
  # join the same count). The permits are byte-range locks on a file in
  # /dev/shm, held by the kernel for the process that took them: a holder
  # killed with SIGKILL gives its permits back as it dies, and a process
  # forked from a holder (a worker from a mold) holds none.
  #
  # Order: first come, first served among the waiters of one process, which
  # queue in memory so that only the first of them contends; between
  # processes there is no order (the first waiting process to look after a
  # permit is given back takes it). A waiter looks at once when a permit of
  # its own process is given back, and otherwise after 1 ms, doubling up to
  # 20 ms between looks.
  #
  # A waiter that is cancelled or times out takes no permit; a holder gives
  # its permit back however its block ends.
  class ServerSemaphore
    # Where the permit files live when /dev/shm is missing (not Linux).
    FALLBACK_DIRECTORY = Dir.tmpdir

    # @return [String]
    attr_reader :name

    # @return [Integer] how many may hold it at once.
    attr_reader :limit

    # @param name [String] letters, digits, `_`, `-` and `.`: the same name
    #   is the same semaphore in every process of this machine (of this
    #   user), so include your app's name when several apps share a host.
    # @param limit [Integer] >= 1. Processes may disagree (while a deploy
    #   changes it): each bounds what it takes by its own limit.
    # @param directory [String] where the permit file (an empty file,
    #   `neverblock-semaphore-NAME`) is created; /dev/shm by default, else
    #   the temp directory. It must be on a local filesystem.
    # @raise [ArgumentError] for a bad name or limit.
    def initialize(name, limit, directory: nil)
      unless name.is_a?(String) && name.match?(/\A[\w.-]{1,200}\z/)
        raise ArgumentError, "name must be 1-200 letters, digits, _, - or ., got #{name.inspect}"
      end

      @name = name
      @limit = NeverBlock.validate_size!(limit, :limit)
      directory ||= File.directory?("/dev/shm") && File.writable?("/dev/shm") ? "/dev/shm" : FALLBACK_DIRECTORY
      @slots = SlotFile.for(File.join(File.expand_path(directory), "neverblock-semaphore-#{name}"))
    end

    # Waits for a permit, runs the block holding it, and gives it back
    # however the block ends.
    #
    # @param timeout [Numeric, nil] seconds to wait for a permit at most
    #   (nil: no limit); the block's own time is not limited.
    # @return [Object] the block's value.
    # @raise [SemaphoreTimeout] when no permit was free within `timeout`.
    def acquire(timeout: nil)
      raise ArgumentError, "ServerSemaphore#acquire needs a block" unless block_given?

      slot = take(timeout)
      begin
        yield
      ensure
        @slots.give_back(slot)
      end
    end

    # @return [Integer] permits free now, in every process (a snapshot).
    def available
      holders.count(nil)
    end

    # @return [Array<Integer>] pids of the processes that hold a permit,
    #   one entry per permit held (for diagnostics and tests).
    def holder_pids
      holders.compact
    end

    # @return [Integer] callers of this process waiting for a permit.
    def waiting
      @slots.waiting
    end

    # @return [String] the permit file.
    def path
      @slots.path
    end

    # @return [String]
    def inspect
      "#<#{self.class.name} #{@name} limit=#{@limit} available=#{available} waiting=#{waiting}>"
    end

    private

    def holders
      @slots.holders(@limit)
    end

    def take(timeout)
      return @slots.take(@limit) if timeout.nil?

      NeverBlock.validate_timeout!(timeout, :timeout)
      begin
        NeverBlock.timeout(timeout) { @slots.take(@limit) }
      rescue TimeoutError
        raise SemaphoreTimeout, "no permit of #{@name} (ServerSemaphore, limit #{@limit}) was free within " \
                                "#{timeout} s (held by pids #{holder_pids.tally.map { |pid, n| n > 1 ? "#{pid} (#{n})" : pid }.join(', ')})"
      end
    end
  end
end
