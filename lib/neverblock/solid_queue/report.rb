# frozen_string_literal: true

require "json"

module NeverBlock
  module SolidQueue
    # Hands a {FiberPool}'s {JobCounts} to the NeverBlock server that
    # supervises this `bin/jobs` (SOLID_QUEUE_IN_PUMA, `supervise`), for
    # its `/metrics`: the master gives its supervised commands a directory
    # in {VARIABLE} (`Server::Cluster::JobMetrics`), and the pool's loop
    # writes its counts there as JSON, to `PID-POOL.json`, every
    # {INTERVAL} seconds while it runs and once more as it ends. Without
    # the variable ({.build} returns nil) nothing is written: a `bin/jobs`
    # of its own has {SolidQueue.stats}.
    #
    # Each write replaces the file in one rename, so the master never reads
    # half of one. Runs as a task of the pool's loop ({#run}).
    class Report
      # The environment variable naming the directory; the master's
      # `Server::Cluster::JobMetrics::VARIABLE` is the same name.
      VARIABLE = "NEVERBLOCK_JOB_METRICS"

      # Seconds between two writes.
      INTERVAL = 1.0

      # Seconds between two looks at whether the pool is done: the loop's
      # end (and the process's shutdown) waits at most this long for it.
      STEP = 0.1

      # @param counts [JobCounts]
      # @param pool_id [Integer] tells a process's pools apart.
      # @param env [Hash] where {VARIABLE} is looked up.
      # @return [Report, nil] nil unless {VARIABLE} names a directory.
      def self.build(counts, pool_id, env = ENV)
        directory = env[VARIABLE]
        new(directory, counts, pool_id) if directory && File.directory?(directory)
      end

      # @param directory [String]
      # @param counts [JobCounts]
      # @param pool_id [Integer]
      def initialize(directory, counts, pool_id)
        @directory = directory
        @counts = counts
        @pool_id = pool_id
      end

      # Writes the counts every {INTERVAL} until the block (asked every
      # {STEP}) says the pool is done, and once more as it ends, however
      # it ends.
      # @yieldreturn [Boolean] whether the pool has ended its last job.
      # @return [void]
      def run
        written_at = nil
        until yield
          if written_at.nil? || Clock.now - written_at >= INTERVAL
            write
            written_at = Clock.now
          end
          NeverBlock.sleep(STEP)
        end
      ensure
        write
      end

      # Replaces this pool's file with its counts now (the pid is in the
      # name: the master reads a file whose process is gone as final).
      # A write that fails is logged, and the next one tries again.
      # @return [void]
      def write
        pid = Process.pid # a fork of the process that built the pool writes its own file
        path = File.join(@directory, "#{pid}-#{@pool_id}.json")
        temporary = "#{path}.tmp"
        File.write(temporary, JSON.generate(@counts.to_h))
        File.rename(temporary, path)
      rescue SystemCallError => e
        NeverBlock.logger.warn("NeverBlock") { "Solid Queue job metrics not written to #{@directory}: #{e.message}" }
      end
    end
  end
end
