#!/usr/bin/env ruby
# frozen_string_literal: true

# The 2009 "fibers vs threads" comparison, rebuilt.
#
# 1. Concurrency: N tasks that all sleep at once (default N = 10_000 and
#    100_000, each sleeping --sleep seconds; by default 2 s, or 1 s per
#    10_000 tasks if that is longer, so all are started before any wakes). Per variant: time to start them
#    all, wall time until the last one is done, and peak RSS (VmHWM of a
#    forked child that measures only that variant). Variants: threads, raw
#    fibers (Fiber.new with a hand-rolled sleep queue, no scheduler: the lower
#    bound), NeverBlock.spawn, NeverBlock::FiberPool(size: N), Async tasks.
# 2. Cost: spawning and finishing a task with an empty block, in microseconds
#    per task, best of 3 runs of --spawns tasks (in batches of 1000).
#
#   bench/run fibers [options]              Ruby 3.1 (bench/results/)
#   bench/run --ruby 3.3 fibers [options]   Ruby 3.3, newest async (bench/results/ruby33/)
#   BUNDLE_PATH=vendor/bundle bundle exec ruby bench/fibers.rb
#   ... bench/fibers.rb --counts 1000,10000 --sleep 0.5 --only fibers,neverblock
#
# Every fiber stack is two memory mappings, so 100_000 live fibers need
# vm.max_map_count well above the kernel's default 65530. When it is too low
# for the largest count, the script raises it (as root, like `sysctl -w`),
# says so and leaves it raised; --no-raise-map-count leaves it alone.
# NeverBlock and Async run on the same io-event selector (--selector, EPoll
# unless told; see bench/support/peers.rb).
#
# Writes <out>/fibers.csv and <out>/fibers.svg (default out: bench/results).

require_relative "support/harness"

module NeverBlockBench
  # Runs the fibers-vs-threads benchmark and reports it. See the file comment.
  class FibersBench
    # A way of running tasks. `sleepers` starts `count` tasks that each sleep
    # `seconds`, calls `spawned` once all are started, and returns when all
    # are done. `empties` runs `count` empty tasks, `batch` at a time.
    Variant = Struct.new(:name, :label, :library, :sleepers, :empties, keyword_init: true)

    DEFAULTS = {
      counts: [10_000, 100_000],
      sleep: nil, # see #sleep_for
      spawns: 100_000,
      only: nil,
      out: File.expand_path("results", __dir__),
      selector: Peers::DEFAULT_SELECTOR,
      raise_map_count: true
    }.freeze
    BATCH = 1000
    # Default sleep, in seconds: long enough that every task is started
    # before the first one wakes, so peak RSS counts all of them (starting
    # 100_000 Async tasks takes about 6 s on a small machine).
    MIN_SLEEP = 2.0
    SLEEP_PER_TASK = 0.0001
    MICRO_RUNS = 3
    # Memory mappings per thread (machine stack, its guard page, the VM
    # stack) and per fiber stack (stack and guard page): vm.max_map_count
    # divided by these bounds how many can exist at once.
    MAPPINGS_PER_THREAD = 3
    MAPPINGS_PER_FIBER = 2
    # Mappings a process has besides its fibers' stacks (heap, libraries,
    # the VM's own), with room to spare.
    MAPPINGS_BESIDES = 10_000
    # What vm.max_map_count is raised to when too low: the value commonly
    # recommended (e.g. for Elasticsearch), or more if the counts need it.
    MAP_COUNT_TARGET = 262_144

    def initialize(options)
      @options = DEFAULTS.merge(options)
      @options[:spawns] = [(@options[:spawns] / BATCH) * BATCH, BATCH].max
      @variants = all_variants
      return unless @options[:only]

      unknown = @options[:only] - @variants.map(&:name)
      raise OptionParser::InvalidArgument, "unknown variant(s) #{unknown.join(', ')}" unless unknown.empty?

      @variants.select! { |variant| @options[:only].include?(variant.name) }
    end

    # @return [Boolean] true when every variant that was not skipped ran
    def call
      map_count_note = ensure_map_count
      @selector = Peers.use_selector(@options[:selector])
      @probe = Peers.probe
      puts header
      puts map_count_note if map_count_note
      unless Peers.selector_matches?(@probe, @selector)
        warn "NeverBlock and async are not on the same selector (see above); not measuring"
        return false
      end
      concurrency = measure_concurrency
      micro = measure_micro
      report(concurrency, micro)
      (concurrency + micro).none? { |row| row[:failure] && !limit_reached?(row[:failure]) }
    end

    private

    def all_variants
      [
        Variant.new(name: "threads", label: "threads (Thread.new)", library: nil,
                    sleepers: method(:thread_sleepers), empties: method(:thread_empties)),
        Variant.new(name: "fibers", label: "raw fibers (Fiber.new + sleep queue)", library: nil,
                    sleepers: method(:fiber_sleepers), empties: method(:fiber_empties)),
        Variant.new(name: "neverblock", label: "NeverBlock.spawn", library: "neverblock",
                    sleepers: method(:neverblock_sleepers), empties: method(:neverblock_empties)),
        Variant.new(name: "pool", label: "NeverBlock::FiberPool", library: "neverblock",
                    sleepers: method(:pool_sleepers), empties: method(:pool_empties)),
        Variant.new(name: "async", label: "Async tasks (async #{Machine.gem_version('async')})", library: "async",
                    sleepers: method(:async_sleepers), empties: method(:async_empties))
      ]
    end

    # --- the variants ------------------------------------------------------

    def thread_sleepers(count, seconds, spawned)
      threads = Array.new(count) { Thread.new { sleep(seconds) } }
      spawned.call
      threads.each(&:join)
    end

    def thread_empties(count, batch)
      (count / batch).times { Array.new(batch) { Thread.new {} }.each(&:join) }
    end

    # No scheduler: each fiber "sleeps" by yielding its wake-up time to this
    # loop, which resumes it then. Every fiber sleeps equally long, so the
    # queue is already in deadline order and a plain FIFO suffices.
    def fiber_sleepers(count, seconds, spawned)
      queue = Array.new(count) do
        fiber = Fiber.new { Fiber.yield(Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds) }
        [fiber.resume, fiber]
      end
      spawned.call
      queue.each do |deadline, fiber|
        remaining = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
        Kernel.sleep(remaining) if remaining.positive?
        fiber.resume
      end
    end

    def fiber_empties(count, batch)
      (count / batch).times { Array.new(batch) { Fiber.new {} }.each(&:resume) }
    end

    def neverblock_sleepers(count, seconds, spawned)
      NeverBlock.run do
        tasks = Array.new(count) { NeverBlock.spawn { sleep(seconds) } }
        spawned.call
        NeverBlock.wait_all(tasks)
      end
    end

    def neverblock_empties(count, batch)
      NeverBlock.run do
        (count / batch).times { NeverBlock.wait_all(Array.new(batch) { NeverBlock.spawn {} }) }
      end
    end

    def pool_sleepers(count, seconds, spawned)
      NeverBlock.run do
        pool = NeverBlock::FiberPool.new(size: count, queue_limit: count)
        tasks = Array.new(count) { pool.spawn { sleep(seconds) } }
        spawned.call
        NeverBlock.wait_all(tasks)
        pool.shutdown
      end
    end

    def pool_empties(count, batch)
      NeverBlock.run do
        pool = NeverBlock::FiberPool.new(size: batch, queue_limit: batch)
        (count / batch).times { NeverBlock.wait_all(Array.new(batch) { pool.spawn {} }) }
        pool.shutdown
      end
    end

    def async_sleepers(count, seconds, spawned)
      Async do |task|
        tasks = Array.new(count) { task.async { sleep(seconds) } }
        spawned.call
        tasks.each(&:wait)
      end.wait
    end

    def async_empties(count, batch)
      Async do |task|
        (count / batch).times { Array.new(batch) { task.async {} }.each(&:wait) }
      end.wait
    end

    # --- measuring -----------------------------------------------------------

    # Mappings needed for the largest count of fibers alive at once.
    def map_count_needed
      (@options[:counts].max * MAPPINGS_PER_FIBER) + MAPPINGS_BESIDES
    end

    # Makes vm.max_map_count large enough for the largest count, if it can.
    #
    # @return [String, nil] what was done or why not, for the report; nil
    #   when the limit was already high enough
    def ensure_map_count
      needed = map_count_needed
      status, value, detail = if @options[:raise_map_count]
                                Machine.raise_sysctl("vm/max_map_count", minimum: needed,
                                                                         target: [MAP_COUNT_TARGET, needed].max)
                              else
                                current = Machine.sysctl("vm/max_map_count")
                                low = current && current < needed
                                low ? [:failed, current, "--no-raise-map-count"] : [:ok, current, nil]
                              end
      note = case status
             when :ok, :unknown then nil
             when :raised
               "Raised vm.max_map_count from #{value} to #{detail} for #{@options[:counts].max} fibers " \
                 "(#{MAPPINGS_PER_FIBER} mappings each); it stays raised: " \
                 "`sysctl -w vm.max_map_count=#{value}` restores it."
             else
               "vm.max_map_count=#{value.inspect} is below the #{needed} that #{@options[:counts].max} fibers " \
                 "need and was not raised (#{detail}): expect FiberError at that count. " \
                 "`sysctl -w vm.max_map_count=#{[MAP_COUNT_TARGET, needed].max}` as root lifts it."
             end
      note
    end

    # @return [Float] seconds each of `count` tasks sleeps: --sleep, or by
    #   default MIN_SLEEP and more for large counts
    def sleep_for(count)
      @options[:sleep] || [MIN_SLEEP, (count * SLEEP_PER_TASK).round(1)].max
    end

    def header
      <<~TEXT
        NeverBlock fibers benchmark: N concurrent sleeping tasks, and the cost of an empty task
        #{Machine.ruby_description}
        #{Peers.versions_text(@probe)}
        #{Peers.selector_text(@probe, @selector)}
        #{Machine.description}; kernel.pid_max=#{Machine.sysctl('kernel/pid_max')}, vm.max_map_count=#{Machine.sysctl('vm/max_map_count')}
        Each variant runs in its own forked process; peak RSS is that process's VmHWM, reset at its start.
        load average at start: #{Machine.load_average}
      TEXT
    end

    def measure_concurrency
      @options[:counts].flat_map do |count|
        @variants.map do |variant|
          row = concurrency_row(variant, count)
          warn progress_line(row)
          row
        end
      end
    end

    def concurrency_row(variant, count)
      base = { variant: variant, count: count }
      skip = skip_reason(variant, count)
      return base.merge(skipped: skip) if skip

      seconds = sleep_for(count)
      outcome = Isolated.run(timeout: 30 + (seconds * 3)) do
        require variant.library if variant.library
        GC.start
        Machine.reset_peak_rss
        baseline_kb = Machine.status_kb("VmRSS")
        spawned_at = nil
        started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        variant.sleepers.call(count, seconds, -> { spawned_at = Process.clock_gettime(Process::CLOCK_MONOTONIC) })
        finished = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        { spawn_seconds: spawned_at - started, wall_seconds: finished - started,
          baseline_kb: baseline_kb, peak_kb: Machine.status_kb("VmHWM") }
      end
      return base.merge(failure: outcome.to_s) if outcome.is_a?(Isolated::Failure)

      base.merge(outcome)
    end

    # Threads are kernel tasks: past the limits below Thread.new fails, and
    # getting there can starve the rest of the machine of processes.
    def skip_reason(variant, count)
      return nil unless variant.name == "threads"

      pid_max = Machine.sysctl("kernel/pid_max")
      threads_max = Machine.sysctl("kernel/threads-max")
      map_count = Machine.sysctl("vm/max_map_count")
      limits = {
        "kernel.pid_max=#{pid_max} (tasks system-wide)" => pid_max,
        "kernel.threads-max=#{threads_max}" => threads_max,
        "vm.max_map_count=#{map_count} (~#{MAPPINGS_PER_THREAD} mappings per thread)" =>
          map_count && map_count / MAPPINGS_PER_THREAD
      }.compact.reject { |_, limit| limit.nil? }
      reason, limit = limits.min_by { |_, value| value }
      return nil if limit.nil? || count <= limit * 0.8

      "skipped: #{count} threads exceed #{reason}, about #{limit} threads at most"
    end

    def measure_micro
      count = @options[:spawns]
      @variants.map do |variant|
        outcome = Isolated.run(timeout: 300) do
          require variant.library if variant.library
          variant.empties.call(BATCH, BATCH) # warm up
          Array.new(MICRO_RUNS) do
            GC.start
            started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
            variant.empties.call(count, BATCH)
            Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
          end.min
        end
        row = { variant: variant, count: count }
        row = outcome.is_a?(Isolated::Failure) ? row.merge(failure: outcome.to_s) : row.merge(seconds: outcome)
        warn micro_progress_line(row)
        row
      end
    end

    # --- reporting ----------------------------------------------------------

    # Failures that mean "the OS allows no more threads or fibers": results
    # to report, not errors of this script.
    LIMIT_ERRORS = /\A(FiberError|ThreadError|NoMemoryError|Errno::EAGAIN|Errno::ENOMEM)\b/

    def limit_reached?(failure)
      LIMIT_ERRORS.match?(failure)
    end

    def progress_line(row)
      cell = "#{row[:variant].name} x #{row[:count]}"
      return "  #{cell}: #{row[:skipped]}" if row[:skipped]
      return "  #{cell}: FAILED #{row[:failure]}" if row[:failure]

      format("  %s: started in %.2f s, done in %.2f s, peak RSS %.0f MB", cell, row[:spawn_seconds],
             row[:wall_seconds], row[:peak_kb] / 1024.0)
    end

    def micro_progress_line(row)
      cell = "#{row[:variant].name} empty task x #{row[:count]}"
      return "  #{cell}: FAILED #{row[:failure]}" if row[:failure]

      format("  %s: %.2f us per task", cell, per_task_us(row))
    end

    def per_task_us(row)
      row[:seconds] * 1_000_000 / row[:count]
    end

    def per_task_kb(row)
      (row[:peak_kb] - row[:baseline_kb]).to_f / row[:count]
    end

    def report(concurrency, micro)
      puts "\nload average at end: #{Machine.load_average}"
      puts "NeverBlock and async variants on io-event #{@selector}" if @variants.any?(&:library)
      puts "#{@options[:counts].map { |count| "#{count} tasks sleeping #{sleep_for(count)} s" }.join(', ')}; " \
           "all tasks of a run at once"
      puts concurrency_table(concurrency)
      puts "start all: time until the loop that spawns the tasks returned. Where spawning only queues a " \
           "task (its fiber starts on a later turn of the loop), this is smaller and the rest shows in wall."
      notes = concurrency_notes(concurrency)
      puts notes unless notes.empty?
      puts "\nSpawn and finish an empty task: best of #{MICRO_RUNS} runs of #{@options[:spawns]}, " \
           "in batches of #{BATCH} (FiberPool size #{BATCH})"
      puts micro_table(micro)
      FileUtils.mkdir_p(@options[:out])
      csv = write_csv(concurrency, micro)
      svg = write_svg(concurrency, micro)
      puts "\nwrote #{CommandLine.relative(csv)} and #{CommandLine.relative(svg)}"
    end

    def concurrency_table(rows)
      table = Table.new(["variant", "tasks", "start all s", "wall s", "over sleep s", "peak RSS MB", "KB/task"])
      rows.each do |row|
        label = row[:variant].name == "pool" ? "#{row[:variant].label}(size: #{row[:count]})" : row[:variant].label
        table << [label, row[:count]] + concurrency_cells(row)
      end
      table.to_s
    end

    def concurrency_cells(row)
      return [row[:skipped] ? "skipped" : "failed", "", "", "", ""] if row[:skipped] || row[:failure]

      [format("%.3f", row[:spawn_seconds]), format("%.3f", row[:wall_seconds]),
       format("%.3f", row[:wall_seconds] - sleep_for(row[:count])), format("%.0f", row[:peak_kb] / 1024.0),
       format("%.1f", per_task_kb(row))]
    end

    def concurrency_notes(rows)
      notes = rows.select { |row| row[:skipped] || row[:failure] }.map do |row|
        "#{row[:variant].name} x #{row[:count]}: #{row[:skipped] || row[:failure]}"
      end
      if rows.any? { |row| row[:failure].to_s.include?("guard page") || row[:failure].to_s.include?("stack") }
        notes << "Each fiber stack is #{MAPPINGS_PER_FIBER} memory mappings, so vm.max_map_count=" \
                 "#{Machine.sysctl('vm/max_map_count')} allows about " \
                 "#{Machine.sysctl('vm/max_map_count').to_i / MAPPINGS_PER_FIBER} live fibers per process; " \
                 "`sysctl -w vm.max_map_count=262144` lifts that."
      end
      slow = rows.select { |row| row[:spawn_seconds] && row[:spawn_seconds] > sleep_for(row[:count]) }
      unless slow.empty?
        notes << "Starting took longer than the sleep for #{slow.map { |row| "#{row[:variant].name} x #{row[:count]}" }.join(', ')}: " \
                 "not all of those tasks were alive at once."
      end
      notes.map { |note| "#{note}\n" }.join
    end

    def micro_table(rows)
      table = Table.new(["variant", "tasks", "us per task"])
      rows.each do |row|
        table << [row[:variant].label, row[:count], row[:failure] ? "failed" : format("%.2f", per_task_us(row))]
      end
      table.to_s
    end

    def write_csv(concurrency, micro)
      path = File.join(@options[:out], "fibers.csv")
      header = %w[benchmark variant tasks sleep_s start_all_s wall_s peak_rss_mb kb_per_task us_per_task selector
                  note]
      rows = concurrency.map do |row|
        measured = row[:wall_seconds]
        ["concurrent_sleep", row[:variant].name, row[:count], sleep_for(row[:count]),
         row[:spawn_seconds]&.round(4), measured&.round(4), measured && (row[:peak_kb] / 1024.0).round(1),
         measured && per_task_kb(row).round(2), nil, (@selector if row[:variant].library),
         row[:skipped] || row[:failure]]
      end
      rows += micro.map do |row|
        ["empty_task", row[:variant].name, row[:count], nil, nil, row[:seconds]&.round(4), nil, nil,
         row[:seconds] && per_task_us(row).round(3), (@selector if row[:variant].library), row[:failure]]
      end
      File.write(path, ([header] + rows).map { |row| row.map { |cell| csv_cell(cell) }.join(",") }.join("\n") + "\n")
      path
    end

    def csv_cell(cell)
      text = cell.to_s
      text.match?(/[",\n]/) ? "\"#{text.gsub('"', '""')}\"" : text
    end

    def write_svg(concurrency, micro)
      chart = SvgChart.new(title: "Fibers vs threads: #{@options[:counts].join(' and ')} tasks sleeping at once",
                           subtitle: ["ruby #{RUBY_VERSION}, #{Machine.description}",
                                      "#{Peers.versions_text(@probe)}, #{@selector} selector for both"])
      categories = @options[:counts].map { |count| "#{count} tasks, #{sleep_for(count)} s sleep" }
      chart.add_panel(title: "peak RSS, MB (lower is better)", categories: categories,
                      series: series(concurrency) { |row| bar_value(row) { row[:peak_kb] / 1024.0 } })
      chart.add_panel(title: "wall time, s (lower is better)", categories: categories,
                      series: series(concurrency) { |row| bar_value(row) { row[:wall_seconds] } })
      chart.add_panel(title: "spawn + finish an empty task, us (lower is better)", categories: ["#{@options[:spawns]} tasks"],
                      series: @variants.to_h do |variant|
                        row = micro.find { |candidate| candidate[:variant].equal?(variant) }
                        [variant.label, [row[:seconds] ? per_task_us(row) : "failed"]]
                      end)
      chart.write(File.join(@options[:out], "fibers.svg"))
    end

    # @return [Numeric, String] the block's value, or why there is none
    def bar_value(row)
      return "skipped" if row[:skipped]
      return "failed" if row[:failure]

      yield
    end

    # @yieldparam row [Hash] a measured, skipped or failed row
    # @yieldreturn [Numeric, nil] the bar's value; nil for "n/a"
    def series(rows)
      @variants.to_h do |variant|
        [variant.label, @options[:counts].map do |count|
          yield(rows.find { |row| row[:variant].equal?(variant) && row[:count] == count })
        end]
      end
    end
  end
end

if $PROGRAM_NAME == __FILE__
  options = {}
  parser = OptionParser.new do |opts|
    opts.banner = "Usage: ruby bench/fibers.rb [options]"
    opts.on("--counts LIST", Array, "concurrent tasks per run (10000,100000)") do |list|
      options[:counts] = list.map { |value| Integer(value.delete("_")) }
    end
    opts.on("--sleep SECONDS", Float, "how long each task sleeps (2 s, or 1 s per 10_000 tasks)") do |value|
      options[:sleep] = value
    end
    opts.on("--spawns N", Integer, "empty tasks per micro-benchmark run (100000)") do |value|
      options[:spawns] = value
    end
    NeverBlockBench::CommandLine.shared_options(opts, options, results: "fibers",
                                                               variants: "threads,fibers,neverblock,pool,async")
    opts.on("--[no-]raise-map-count", "raise vm.max_map_count when too low for the counts (as root; on)") do |value|
      options[:raise_map_count] = value
    end
  end
  NeverBlockBench::CommandLine.run(parser) { NeverBlockBench::FibersBench.new(options).call }
end
