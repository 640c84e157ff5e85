# frozen_string_literal: true

require "fileutils"
require "json"
require "tmpdir"
require_relative "../../solid_queue/job_counts"

module NeverBlock
  class Server
    class Cluster
      # The jobs of the Solid Queue fiber workers that run under a
      # supervised `bin/jobs` ({Sidecars}), for {Prometheus}: made by a
      # master that has a control listener and supervises a command. It
      # makes a directory of its own and gives its path to the supervised
      # commands in {VARIABLE}; each Solid Queue worker process's fiber
      # pool writes its counts there (`NeverBlock::SolidQueue::Report`,
      # `PID-POOL.json`), and {#read} adds them up.
      #
      # The counts of a process that has exited (a worker Solid Queue
      # replaced, a `bin/jobs` the master restarted) are kept, so that the
      # counters only grow, and its file is removed; its jobs no longer
      # count as running.
      #
      # Who calls it: {Cluster} makes it and closes it ({#close}) on the
      # master's loop; {Prometheus} reads it ({#read}) on the control
      # listener's thread. `@lock` guards the kept counts.
      class JobMetrics
        # The environment variable the supervised commands get; read by
        # `NeverBlock::SolidQueue::Report::VARIABLE` in their processes.
        VARIABLE = "NEVERBLOCK_JOB_METRICS"

        # The outcomes of a job counted (`NeverBlock::SolidQueue::JobCounts`).
        OUTCOMES = (SolidQueue::JobCounts::COUNTS - [:running]).map(&:to_s).freeze

        # @return [String] the directory the counts are written to.
        attr_reader :directory

        def initialize
          @directory = Dir.mktmpdir("neverblock-jobs-")
          @lock = Mutex.new
          @ended = nil # the counts of processes that have exited
        end

        # @return [Hash{String => String}] for the supervised commands' environment.
        def env
          { VARIABLE => @directory }
        end

        # @return [Hash, nil] `NeverBlock::SolidQueue::JobCounts#to_h`
        #   summed over every pool that wrote its counts since the master
        #   started; nil when none has yet.
        def read
          @lock.synchronize do
            live = []
            Dir.glob(File.join(@directory, "*.json")).each do |path|
              counts = parse(path) or next
              if alive?(Integer(File.basename(path)[/\A\d+/]))
                live << counts
              else
                @ended = SolidQueue::JobCounts.sum([@ended, counts.merge(running: 0)].compact)
                File.delete(path)
              end
            end
            SolidQueue::JobCounts.sum([@ended, *live].compact) if @ended || !live.empty?
          end
        end

        # Removes the directory (the master is stopping).
        # @return [void]
        def close
          FileUtils.rm_rf(@directory)
        end

        private

        def parse(path)
          counts = JSON.parse(File.read(path), symbolize_names: true)
          counts if SolidQueue::JobCounts.shaped?(counts)
        rescue JSON::ParserError, SystemCallError
          nil # gone meanwhile (its process ended and another read removed it), or not ours
        end

        def alive?(pid)
          Process.kill(0, pid)
          true
        rescue Errno::ESRCH
          false
        rescue Errno::EPERM
          true
        end
      end
    end
  end
end
