#!/usr/bin/env ruby
# frozen_string_literal: true

# The 2009 "fibers vs threads" comparison:
# 1. N tasks that all sleep at once (N = 10_000 and 100_000, each sleeping
#    2 s, or 1 s per 10_000 tasks if longer, so all start before any wakes):
#    time to start them, wall time, peak RSS (VmHWM of the forked child that
#    runs only that variant). Variants: threads, raw fibers with a hand-rolled
#    sleep queue (the lower bound), NeverBlock.spawn, NeverBlock::FiberPool, Async.
# 2. Spawning and finishing an empty task, µs per task, best of 3 runs of
#    --spawns tasks in batches of 1000.
#
#   bench/run fibers                        Ruby 3.1 -> bench/results/fibers.{txt,csv,svg}
#   bench/run --ruby 3.3 fibers             Ruby 3.3 -> bench/results/ruby33/
#   bench/run fibers --quick                smoke run: 1000 tasks, 0.2 s, 2000 spawns
#
# A fiber stack is two memory mappings, so 100_000 fibers need vm.max_map_count
# above the default 65530: as root the script raises it and leaves it raised
# (--no-raise-map-count leaves it alone).

require_relative "support/harness"

module NeverBlockBench
  # Runs the fibers-vs-threads benchmark and reports it. See the file comment.
  class FibersBench
    # `sleepers.(count, seconds, spawned)` starts `count` sleeping tasks, calls
    # `spawned` once all are started and returns when all are done;
    # `empties.(count, batch)` runs `count` empty tasks, `batch` at a time.
    Variant = Struct.new(:name, :label, :library, :sleepers, :empties, keyword_init: true)

    DEFAULTS = { counts: [10_000, 100_000], sleep: nil, spawns: 100_000, out: RESULTS, selector: Peers::DEFAULT_SELECTOR,
                 raise_map_count: true }.freeze
    QUICK = { counts: [1000], sleep: 0.2, spawns: 2000 }.freeze
    BATCH = 1000
    MICRO_RUNS = 3
    # Memory mappings per thread (stack, guard page, VM stack) and per fiber
    # (stack, guard page), and what a process has besides.
    MAPPINGS_PER_THREAD = 3
    MAPPINGS_PER_FIBER = 2
    MAPPINGS_BESIDES = 10_000
    MAP_COUNT_TARGET = 262_144 # the value commonly recommended
    # Failures meaning "the OS allows no more": results, not errors of this script.
    LIMIT_ERRORS = /\A(FiberError|ThreadError|NoMemoryError|Errno::EAGAIN|Errno::ENOMEM)\b/

    def initialize(options)
      @options = options
      @options[:spawns] = [(@options[:spawns] / BATCH) * BATCH, BATCH].max
      @variants = CommandLine.select(variants, @options[:only])
    end

    # @return [Boolean] true when every variant that was not skipped or limited ran
    def call
      note = map_count_note
      @probe = Peers.start(@options[:selector]) { |probe, selector| header(probe, @selector = selector) + note.to_s } or return false
      concurrency = @options[:counts].flat_map { |count| @variants.map { |variant| concurrency_row(variant, count) } }
      micro = @variants.map { |variant| micro_row(variant) }
      report(concurrency, micro)
      (concurrency + micro).none? { |row| row[:failure] && !LIMIT_ERRORS.match?(row[:failure]) }
    end

    private

    def variants
      nb = ->(&body) { NeverBlock.run(&body) }
      async = ->(&body) { Async(&body).wait }
      [Variant.new(name: "threads", label: "threads (Thread.new)",
                   sleepers: ->(count, seconds, spawned) { Array.new(count) { Thread.new { sleep(seconds) } }.tap { spawned.call }.each(&:join) },
                   empties: ->(count, batch) { (count / batch).times { Array.new(batch) { Thread.new {} }.each(&:join) } }),
       # No scheduler: a fiber "sleeps" by yielding its wake-up time; all sleep
       # equally long, so the queue is in deadline order already.
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

    # Raises vm.max_map_count for the largest count when it can.
    # @return [String, nil] what was done or why not; nil when it was high enough
    def map_count_note
      needed = (@options[:counts].max * MAPPINGS_PER_FIBER) + MAPPINGS_BESIDES
      target = [MAP_COUNT_TARGET, needed].max
      status, value, detail =
        if @options[:raise_map_count]
          Machine.raise_sysctl("vm/max_map_count", minimum: needed, target: target)
        else
          current = Machine.sysctl("vm/max_map_count")
          current && current < needed ? [:failed, current, "--no-raise-map-count"] : [:ok]
        end
      case status
      when :raised
        "Raised vm.max_map_count from #{value} to #{detail} for #{@options[:counts].max} fibers (#{MAPPINGS_PER_FIBER} " \
          "mappings each); it stays raised: `sysctl -w vm.max_map_count=#{value}` restores it.\n"
      when :failed
        "vm.max_map_count=#{value.inspect} is below the #{needed} that #{@options[:counts].max} fibers need and was not " \
          "raised (#{detail}): expect FiberError at that count. `sysctl -w vm.max_map_count=#{target}` as root lifts it.\n"
      end
    end

    def sleep_for(count) = @options[:sleep] || [2.0, (count * 0.0001).round(1)].max

    def header(probe, selector)
      <<~TEXT
        NeverBlock fibers benchmark: N concurrent sleeping tasks, and the cost of an empty task
        #{Machine.ruby_description}
        #{Peers.versions_text(probe)}
        #{Peers.selector_text(probe, selector)}
        #{Machine.description}; kernel.pid_max=#{Machine.sysctl('kernel/pid_max')}, vm.max_map_count=#{Machine.sysctl('vm/max_map_count')}
        Each variant runs in its own forked process; peak RSS is that process's VmHWM, reset at its start.
        load average at start: #{Machine.load_average}
      TEXT
    end

    def concurrency_row(variant, count)
      row = { variant: variant, count: count }
      if (skipped = thread_limit(variant, count))
        warn "  #{variant.name} x #{count}: #{skipped}"
        return row.merge(skipped: skipped)
      end
      seconds = sleep_for(count)
      outcome = Isolated.run(timeout: 30 + (seconds * 3)) do
        require variant.library if variant.library
        GC.start
        Machine.reset_peak_rss
        baseline_kb = Machine.status_kb("VmRSS")
        spawned_at = nil
        started = NeverBlockBench.now
        variant.sleepers.call(count, seconds, -> { spawned_at = NeverBlockBench.now })
        { spawn_seconds: spawned_at - started, wall_seconds: NeverBlockBench.now - started,
          baseline_kb: baseline_kb, peak_kb: Machine.status_kb("VmHWM") }
      end
      row = outcome.is_a?(Isolated::Failure) ? row.merge(failure: outcome.to_s) : row.merge(outcome)
      warn "  #{variant.name} x #{count}: " + (row[:failure] ? "FAILED #{row[:failure]}" :
        format("started in %.2f s, done in %.2f s, peak RSS %.0f MB", row[:spawn_seconds], row[:wall_seconds], row[:peak_kb] / 1024.0))
      row
    end

    # Threads are kernel tasks: past these limits Thread.new fails, and getting
    # there can starve the machine of processes.
    def thread_limit(variant, count)
      return nil unless variant.name == "threads"

      map_count = Machine.sysctl("vm/max_map_count")
      limits = { "kernel.pid_max=#{Machine.sysctl('kernel/pid_max')} (tasks system-wide)" => Machine.sysctl("kernel/pid_max"),
                 "kernel.threads-max=#{Machine.sysctl('kernel/threads-max')}" => Machine.sysctl("kernel/threads-max"),
                 "vm.max_map_count=#{map_count} (~#{MAPPINGS_PER_THREAD} mappings per thread)" => map_count && map_count / MAPPINGS_PER_THREAD }
      reason, limit = limits.compact.min_by { |_, value| value }
      "skipped: #{count} threads exceed #{reason}, about #{limit} threads at most" if limit && count > limit * 0.8
    end

    def micro_row(variant)
      count = @options[:spawns]
      outcome = Isolated.run(timeout: 300) do
        require variant.library if variant.library
        variant.empties.call(BATCH, BATCH) # warm up
        Array.new(MICRO_RUNS) do
          GC.start
          started = NeverBlockBench.now
          variant.empties.call(count, BATCH)
          NeverBlockBench.now - started
        end.min
      end
      row = { variant: variant, count: count }
      row = outcome.is_a?(Isolated::Failure) ? row.merge(failure: outcome.to_s) : row.merge(seconds: outcome)
      warn "  #{variant.name} empty task x #{count}: " + (row[:failure] ? "FAILED #{row[:failure]}" : format("%.2f us per task", per_task_us(row)))
      row
    end

    def per_task_us(row) = row[:seconds] * 1_000_000 / row[:count]
    def per_task_kb(row) = (row[:peak_kb] - row[:baseline_kb]).to_f / row[:count]

    def report(concurrency, micro)
      puts "\nload average at end: #{Machine.load_average}"
      puts "NeverBlock and async variants on io-event #{@selector}" if @variants.any?(&:library)
      puts "#{@options[:counts].map { |count| "#{count} tasks sleeping #{sleep_for(count)} s" }.join(', ')}; all tasks of a run at once"
      table = Table.new(["variant", "tasks", "start all s", "wall s", "over sleep s", "peak RSS MB", "KB/task"])
      concurrency.each do |row|
        label = row[:variant].name == "pool" ? "#{row[:variant].label}(size: #{row[:count]})" : row[:variant].label
        table << [label, row[:count]] + (row[:wall_seconds] ? [format("%.3f", row[:spawn_seconds]), format("%.3f", row[:wall_seconds]),
                                                             format("%.3f", row[:wall_seconds] - sleep_for(row[:count])),
                                                             format("%.0f", row[:peak_kb] / 1024.0), format("%.1f", per_task_kb(row))]
                                                          : [row[:skipped] ? "skipped" : "failed", "", "", "", ""])
      end
      puts table
      puts "start all: time until the loop that spawns the tasks returned. Where spawning only queues a task (its fiber " \
           "starts on a later turn of the loop), this is smaller and the rest shows in wall."
      concurrency.select { |row| row[:skipped] || row[:failure] }.each { |row| puts "#{row[:variant].name} x #{row[:count]}: #{row[:skipped] || row[:failure]}" }
      if concurrency.any? { |row| row[:failure].to_s.match?(/guard page|stack/) }
        map_count = Machine.sysctl("vm/max_map_count").to_i
        puts "Each fiber stack is #{MAPPINGS_PER_FIBER} memory mappings, so vm.max_map_count=#{map_count} allows about " \
             "#{map_count / MAPPINGS_PER_FIBER} live fibers per process; `sysctl -w vm.max_map_count=262144` lifts that."
      end
      slow = concurrency.select { |row| row[:spawn_seconds] && row[:spawn_seconds] > sleep_for(row[:count]) }
      puts "Starting took longer than the sleep for #{slow.map { |row| "#{row[:variant].name} x #{row[:count]}" }.join(', ')}: not all of those tasks were alive at once." if slow.any?
      puts "\nSpawn and finish an empty task: best of #{MICRO_RUNS} runs of #{@options[:spawns]}, in batches of #{BATCH} (FiberPool size #{BATCH})"
      table = Table.new(["variant", "tasks", "us per task"])
      micro.each { |row| table << [row[:variant].label, row[:count], row[:failure] ? "failed" : format("%.2f", per_task_us(row))] }
      puts table
      selector = ->(row) { @selector if row[:variant].library }
      rows = concurrency.map do |row|
        wall = row[:wall_seconds]
        ["concurrent_sleep", row[:variant].name, row[:count], sleep_for(row[:count]), row[:spawn_seconds]&.round(4), wall&.round(4),
         wall && (row[:peak_kb] / 1024.0).round(1), wall && per_task_kb(row).round(2), nil, selector.call(row), row[:skipped] || row[:failure]]
      end
      rows += micro.map do |row|
        ["empty_task", row[:variant].name, row[:count], nil, nil, row[:seconds]&.round(4), nil, nil, row[:seconds] && per_task_us(row).round(3),
         selector.call(row), row[:failure]]
      end
      NeverBlockBench.write_results(@options[:out], "fibers", %w[benchmark variant tasks sleep_s start_all_s wall_s peak_rss_mb kb_per_task
                                                                  us_per_task selector note], rows, chart(concurrency, micro))
    end

    def chart(concurrency, micro)
      chart = SvgChart.new(title: "Fibers vs threads: #{@options[:counts].join(' and ')} tasks sleeping at once",
                           subtitle: ["ruby #{RUBY_VERSION}, #{Machine.description}", "#{Peers.versions_text(@probe)}, #{@selector} selector for both"])
      categories = @options[:counts].map { |count| "#{count} tasks, #{sleep_for(count)} s sleep" }
      series = lambda do |&value|
        @variants.to_h do |variant|
          [variant.label, @options[:counts].map do |count|
            row = concurrency.find { |candidate| candidate[:variant].equal?(variant) && candidate[:count] == count }
            row[:skipped] ? "skipped" : row[:failure] ? "failed" : value.call(row) # rubocop:disable Style/NestedTernaryOperator
          end]
        end
      end
      chart.add_panel(title: "peak RSS, MB (lower is better)", categories: categories, series: series.call { |row| row[:peak_kb] / 1024.0 })
      chart.add_panel(title: "wall time, s (lower is better)", categories: categories, series: series.call { |row| row[:wall_seconds] })
      chart.add_panel(title: "spawn + finish an empty task, us (lower is better)", categories: ["#{@options[:spawns]} tasks"],
                      series: micro.to_h { |row| [row[:variant].label, [row[:seconds] ? per_task_us(row) : "failed"]] })
    end
  end
end

if $PROGRAM_NAME == __FILE__
  NeverBlockBench::CommandLine.main(NeverBlockBench::FibersBench, "fibers", variants: "threads,fibers,neverblock,pool,async") do |opts, options|
    opts.on("--counts LIST", Array, "concurrent tasks per run (10000,100000)") { |list| options[:counts] = list.map { |v| Integer(v.delete("_")) } }
    opts.on("--sleep SECONDS", Float, "how long each task sleeps (2 s, or 1 s per 10_000 tasks)") { |value| options[:sleep] = value }
    opts.on("--spawns N", Integer, "empty tasks per micro-benchmark run (100000)") { |value| options[:spawns] = value }
  end
end
