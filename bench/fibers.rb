#!/usr/bin/env ruby
# frozen_string_literal: true

# 2009's "fibers vs threads": (1) N tasks (--counts) sleeping at once, each
# long enough that all start before any wakes: time to start them, wall
# time, peak RSS of the forked child running that variant alone; threads, raw
# fibers (the lower bound), NeverBlock.spawn, FiberPool, Async; (2) the µs to
# spawn and finish an empty task, best of 3. As root it raises
# vm.max_map_count for 100_000 fibers (two mappings each) and leaves it.
#
#   bench/run fibers                        Ruby 3.1 -> bench/results/fibers.{txt,csv,svg}
#   bench/run --ruby 3.3 fibers             Ruby 3.3 -> bench/results/ruby33/
#   bench/run fibers --quick                smoke run: 1000 tasks, 0.2 s, 2000 spawns

require_relative "support/harness"

module NeverBlockBench
  class FibersBench < Bench
    # `sleepers.(count, seconds, spawned)` starts `count` sleeping tasks, calls
    # `spawned` once all are started and returns when all are done;
    # `empties.(count, batch)` runs `count` empty tasks, `batch` at a time.
    Variant = Struct.new(:name, :label, :library, :sleepers, :empties, keyword_init: true)

    DEFAULTS = { counts: [10_000, 100_000], sleep: nil, spawns: 100_000 }.freeze
    QUICK = { counts: [1000], sleep: 0.2, spawns: 2000 }.freeze
    ONLY = %w[threads fibers neverblock pool async].freeze
    BATCH = 1000
    MICRO_RUNS = 3
    # Memory mappings per thread (stack, guard page, VM stack), per fiber (stack, guard page), and besides.
    MAPPINGS_PER_THREAD = 3
    MAPPINGS_PER_FIBER = 2
    MAPPINGS_BESIDES = 10_000
    MAP_COUNT_TARGET = 262_144 # the value commonly recommended
    # Failures meaning "the OS allows no more": results, not errors of this script.
    LIMIT_ERRORS = /\A(FiberError|ThreadError|NoMemoryError|Errno::EAGAIN|Errno::ENOMEM)\b/

    def initialize(options)
      super
      @options[:spawns] = [(@options[:spawns] / BATCH) * BATCH, BATCH].max
      @variants = variants.select { |variant| @options[:only].include?(variant.name) }
    end

    # @return [Boolean] true when every variant that was not skipped or limited ran
    def call
      needed = (@options[:counts].max * MAPPINGS_PER_FIBER) + MAPPINGS_BESIDES
      Machine.raise_sysctl("vm/max_map_count", [needed, MAP_COUNT_TARGET].max)
      @probe = Peers.start { |probe| header(probe) } or return false
      sleeping = @options[:counts].product(@variants).map do |count, variant|
        Cell.new("#{variant.name} x #{count}", variant: variant, count: count, skipped: thread_limit(variant, count))
      end
      NeverBlockBench.rounds(sleeping, 1, timeout: ->(cell) { 30 + (sleep_for(cell[:count]) * 3) }) { |cell| sleep_all(cell) }
      empty = @variants.map { |variant| Cell.new("#{variant.name}, #{@options[:spawns]} empty tasks", variant: variant) }
      NeverBlockBench.rounds(empty, MICRO_RUNS, timeout: 300) { |cell| empty_tasks(cell[:variant]) }
      report(sleeping, empty)
      (sleeping + empty).flat_map(&:failures).all?(LIMIT_ERRORS)
    end

    private

    def variants
      nb = ->(&body) { NeverBlock.run(&body) }
      async = ->(&body) { Async(&body).wait }
      [Variant.new(name: "threads", label: "threads (Thread.new)",
                   sleepers: ->(count, seconds, spawned) { Array.new(count) { Thread.new { sleep(seconds) } }.tap { spawned.call }.each(&:join) },
                   empties: ->(count, batch) { (count / batch).times { Array.new(batch) { Thread.new {} }.each(&:join) } }),
       # No scheduler: a fiber "sleeps" by yielding its wake-up time, all equally long (the queue is in order).
       Variant.new(name: "fibers", label: "raw fibers (Fiber.new + sleep queue)",
                   sleepers: lambda do |count, seconds, spawned|
                     queue = Array.new(count) { Fiber.new { Fiber.yield(NeverBlockBench.now + seconds) }.then { |f| [f.resume, f] } }
                     spawned.call
                     queue.each do |deadline, fiber|
                       remaining = deadline - NeverBlockBench.now
                       Kernel.sleep(remaining) if remaining.positive?
                       fiber.resume
                     end
                   end,
                   empties: ->(count, batch) { (count / batch).times { Array.new(batch) { Fiber.new {} }.each(&:resume) } }),
       Variant.new(name: "neverblock", label: "NeverBlock.spawn", library: "neverblock",
                   sleepers: ->(count, seconds, spawned) { nb.call { NeverBlock.wait_all(Array.new(count) { NeverBlock.spawn { sleep(seconds) } }.tap { spawned.call }) } },
                   empties: ->(count, batch) { nb.call { (count / batch).times { NeverBlock.wait_all(Array.new(batch) { NeverBlock.spawn {} }) } } }),
       Variant.new(name: "pool", label: "NeverBlock::FiberPool", library: "neverblock",
                   sleepers: lambda do |count, seconds, spawned|
                     nb.call do
                       pool = NeverBlock::FiberPool.new(size: count, queue_limit: count)
                       NeverBlock.wait_all(Array.new(count) { pool.spawn { sleep(seconds) } }.tap { spawned.call })
                       pool.shutdown
                     end
                   end,
                   empties: lambda do |count, batch|
                     nb.call do
                       pool = NeverBlock::FiberPool.new(size: batch, queue_limit: batch)
                       (count / batch).times { NeverBlock.wait_all(Array.new(batch) { pool.spawn {} }) }
                       pool.shutdown
                     end
                   end),
       Variant.new(name: "async", label: "Async tasks (async #{Machine.gem_version('async')})", library: "async",
                   sleepers: ->(count, seconds, spawned) { async.call { |task| Array.new(count) { task.async { sleep(seconds) } }.tap { spawned.call }.each(&:wait) } },
                   empties: ->(count, batch) { async.call { |task| (count / batch).times { Array.new(batch) { task.async {} }.each(&:wait) } } })]
    end

    def sleep_for(count) = @options[:sleep] || [2.0, (count * 0.0001).round(1)].max

    def header(probe)
      NeverBlockBench.header(
        "NeverBlock fibers benchmark: N concurrent sleeping tasks, and the cost of an empty task",
        Peers.text(probe),
        "kernel.pid_max=#{Machine.sysctl('kernel/pid_max')}, vm.max_map_count=#{Machine.sysctl('vm/max_map_count')}",
        "Each variant runs in its own forked process; peak RSS is that process's VmHWM, reset at its start."
      )
    end

    # In the child: the cell's count of tasks sleeping at once.
    # @return [Hash] :seconds (wall), :spawn_seconds (until all were started), :peak_kb (RSS)
    def sleep_all(cell)
      require cell[:variant].library if cell[:variant].library
      GC.start
      Machine.reset_peak_rss
      spawned_at = nil
      started = NeverBlockBench.now
      cell[:variant].sleepers.call(cell[:count], sleep_for(cell[:count]), -> { spawned_at = NeverBlockBench.now })
      { seconds: NeverBlockBench.now - started, spawn_seconds: spawned_at - started, peak_kb: Machine.status_kb("VmHWM") }
    end

    # In the child: the seconds --spawns empty tasks took, after a warm-up batch.
    def empty_tasks(variant)
      require variant.library if variant.library
      variant.empties.call(BATCH, BATCH)
      GC.start
      NeverBlockBench.timed { variant.empties.call(@options[:spawns], BATCH) }
    end

    # Threads are kernel tasks: past these limits Thread.new fails, and getting there starves the machine.
    def thread_limit(variant, count)
      return nil unless variant.name == "threads"

      map_count = Machine.sysctl("vm/max_map_count")
      limits = { "kernel.pid_max=#{Machine.sysctl('kernel/pid_max')} (tasks system-wide)" => Machine.sysctl("kernel/pid_max"),
                 "kernel.threads-max=#{Machine.sysctl('kernel/threads-max')}" => Machine.sysctl("kernel/threads-max"),
                 "vm.max_map_count=#{map_count} (~#{MAPPINGS_PER_THREAD} mappings per thread)" => map_count && map_count / MAPPINGS_PER_THREAD }
      reason, limit = limits.compact.min_by { |_, value| value }
      "skipped: #{count} threads exceed #{reason}, about #{limit} threads at most" if limit && count > limit * 0.8
    end

    def report(sleeping, empty)
      rows = sleeping.map do |cell|
        outcome = cell.outcomes.first || {}
        label = cell[:variant].name == "pool" ? "#{cell[:variant].label}(size: #{cell[:count]})" : cell[:variant].label
        { "benchmark" => "concurrent_sleep", "variant" => cell[:variant].name, "label" => label, "tasks" => cell[:count],
          "sleep_s" => sleep_for(cell[:count]), "start_all_s" => outcome[:spawn_seconds]&.round(3), "wall_s" => outcome[:seconds]&.round(3),
          "peak_rss_mb" => outcome[:peak_kb]&.fdiv(1024)&.round, "us_per_task" => nil, "note" => cell.skipped || cell.failures.first }
      end
      puts "#{@options[:counts].map { |count| "#{count} tasks sleeping #{sleep_for(count)} s" }.join(', ')}; all tasks of a run at once"
      puts Table.of(rows, %w[label tasks start_all_s wall_s peak_rss_mb note])
      puts "start_all_s: until the loop that spawns the tasks returned. Where spawning only queues a task (its fiber " \
           "starts on a later turn of the loop), this is smaller and the rest shows in wall_s; above sleep_s, not all tasks were alive at once."
      rows += empty.map do |cell|
        { "benchmark" => "empty_task", "variant" => cell[:variant].name, "label" => cell[:variant].label, "tasks" => @options[:spawns],
          "wall_s" => cell.runs.min&.round(4), "us_per_task" => cell.runs.min&.*(1e6 / @options[:spawns])&.round(2),
          "note" => cell.failures.first }
      end
      puts "\nSpawn and finish an empty task: best of #{MICRO_RUNS} runs of #{@options[:spawns]}, in batches of #{BATCH} (FiberPool size #{BATCH})"
      puts Table.of(rows.select { |row| row["benchmark"] == "empty_task" }, %w[label tasks us_per_task note])
      NeverBlockBench.write_results(@options[:out], "fibers", rows, chart)
    end

    def chart
      sleeping = { "benchmark" => "concurrent_sleep" }
      chart = NeverBlockBench.chart("Fibers vs threads: #{@options[:counts].join(' and ')} tasks sleeping at once", Peers.text(@probe))
      chart.pivot("peak RSS, MB, by tasks (lower is better)", "peak_rss_mb", by: "tasks", series: "variant", where: sleeping)
      chart.pivot("wall time, s, by tasks (lower is better)", "wall_s", by: "tasks", series: "variant", where: sleeping)
      chart.pivot("spawn + finish an empty task, us (lower is better)", "us_per_task", series: "variant", where: { "benchmark" => "empty_task" })
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::FibersBench, "fibers") if $PROGRAM_NAME == __FILE__
