#!/usr/bin/env ruby
# frozen_string_literal: true

# PostgreSQL through NeverBlock::Postgres, against a blocking client, threads
# and pgbench.
#
# 1. Long and short queries, the table of 2009's "Faster IO for Ruby with
#    Postgres": for L = 10, 50 and 100 long queries (`select pg_sleep(0.05)`)
#    and M = 2, 5, 10, 20, 50 and 100 short ones (`select 1`) per long one,
#    iteration i of L issues one long query and M short ones. Blocking: one
#    PG::Connection runs all of them in order. NeverBlock: every query is its
#    own task (NeverBlock.spawn), all started at once, over
#    NeverBlock::Postgres.pool(size: 12). The advantage,
#    (blocking - NeverBlock) / blocking, is printed next to 2009's for the
#    same cell (Ruby 1.9.1, a pool of 50 fibers over 12 connections).
# 2. All short: --queries (10,000) `select $1` (exec_params with an integer
#    parameter): blocking on one connection (also with the CPUs kept awake,
#    see bench/support/spinner.rb); 12 threads with a connection each;
#    NeverBlock from 100 fibers over a pool of 12 connections; the same with
#    `pipeline: true` at pool sizes 2, 4 and 12; pg's pipeline mode driven by
#    hand without a scheduler (what Ruby and pg can do at best); and pgbench
#    (C, libpq) on the same query, -M extended and prepared, 1 and 12
#    clients, plus pgbench's own pipelining for reference. Ruby rows also
#    show the client's CPU time and Ruby allocations per query. The targets:
#    pipelining at least 2x blocking and at least half of pgbench's best;
#    and the client's cost (issue 13): the unpipelined pool at most 1.6x
#    blocking's CPU per query and at least the 12 threads' queries/s, the
#    pipelined pool at most 1.1x blocking's CPU per query.
#
#   bench/run db [options]              Ruby 3.1 (bench/results/), with a throwaway server
#   bench/run --ruby 3.3 db [options]   Ruby 3.3 (bench/results/ruby33/)
#   ... bench/db.rb --only short --short-runs 3 --pipeline-sizes 2,4
#
# bench/run starts PostgreSQL 15 with bin/databases; run directly, the
# script needs the NEVERBLOCK_PG_* variables (bench/support/postgres_server.rb).
# Every measurement runs in its own forked process that connects (and warms
# its connections up) before the clock starts; each cell is measured --runs
# times (part 1) or --short-runs times (part 2), interleaved with the other
# cells, and the median is reported with every run beside it: single runs
# on a small VM that also hosts the server vary by 2x. pgbench needs a
# `pgbench` on PATH (or $PGBENCH); the Ruby 3.3 chroot has none, so there
# the rows are marked n/a.
#
# Writes <out>/db.csv and <out>/db.svg (default out: bench/results).

require_relative "support/harness"
require_relative "support/postgres"

module NeverBlockBench
  # Runs the PostgreSQL benchmark and reports it. See the file comment.
  class DbBench
    include PostgresBench

    # One way of running the all-short queries. `measure` runs in a forked
    # child and returns seconds; `kind` is :ruby or :pgbench.
    Variant = Struct.new(:name, :label, :short_label, :kind, :measure, keyword_init: true)

    DEFAULTS = {
      longs: [10, 50, 100],
      ratios: [2, 5, 10, 20, 50, 100],
      long_seconds: 0.05,
      pool_size: 12,
      runs: 3,
      queries: 10_000,
      fibers: 100,
      threads: 12,
      pipeline_sizes: [2, 4, 12],
      pgbench_clients: [1, 12],
      pipeline_depth: 100,
      short_runs: 5,
      only: nil,
      out: File.expand_path("results", __dir__),
      selector: Peers::DEFAULT_SELECTOR
    }.freeze
    PARTS = %w[longshort short].freeze

    SHORT_SQL = "select 1"
    PARAM_SQL = "select $1"
    # pgbench's version of PARAM_SQL: a random integer sent as a parameter.
    PGBENCH_SCRIPT = "\\set x random(1, 1000)\nselect :x;\n"
    # What the warm-up runs from many tasks at once to open every connection.
    OPEN_SQL = "select pg_sleep(0.02)"
    # Queries each measurement runs before its clock starts.
    WARM_UP = 500

    # 2009's table ("Faster IO for Ruby with Postgres", Ruby 1.9.1):
    # [shorts per long, longs] => [blocking s, non-blocking s, advantage %].
    RESULTS_2009 = {
      [2, 10] => [0.56, 0.5, 10.27], [2, 50] => [2.55, 2.26, 11.19], [2, 100] => [5.15, 4.46, 13.53],
      [5, 10] => [0.55, 0.4, 27.04], [5, 50] => [2.72, 1.83, 32.82], [5, 100] => [5.45, 3.63, 33.39],
      [10, 10] => [0.6, 0.4, 33.76], [10, 50] => [3.01, 1.82, 39.67], [10, 100] => [5.9, 3.65, 38.13],
      [20, 10] => [0.72, 0.45, 38.12], [20, 50] => [3.43, 2.1, 38.73], [20, 100] => [6.83, 4.33, 36.53],
      [50, 10] => [0.98, 0.62, 36.57], [50, 50] => [4.78, 3.23, 32.36], [50, 100] => [9.74, 8.68, 10.93],
      [100, 10] => [1.46, 0.94, 35.4], [100, 50] => [7.42, 5.17, 30.31], [100, 100] => [14.27, 12.68, 11.15]
    }.freeze

    TARGET_VS_BLOCKING = 2.0
    TARGET_VS_PGBENCH = 0.5
    # Client CPU per query at most this many times blocking's (issue 13).
    TARGET_POOL_CPU = 1.6
    TARGET_PIPELINED_CPU = 1.1

    def initialize(options)
      @options = DEFAULTS.merge(options)
      @parts = @options[:only] || PARTS
      unknown = @parts - PARTS
      raise OptionParser::InvalidArgument, "unknown part(s) #{unknown.join(', ')}; use #{PARTS.join(',')}" unless unknown.empty?
    end

    # Runs the parts asked for, prints the tables, writes CSV and SVG.
    #
    # @return [Boolean] true when every measurement succeeded
    def call
      return false unless ready_to_measure?

      long_short = @parts.include?("longshort") ? measure_long_short : []
      short = @parts.include?("short") ? measure_short : []
      report(long_short, short)
      (long_short + short).none? { |row| row[:failures].any? }
    end

    private

    def conninfo
      @conninfo ||= PostgresServer.conninfo
    end

    def header
      <<~TEXT
        NeverBlock PostgreSQL benchmark: long and short queries (the 2009 table), and short queries against pgbench
        #{Machine.ruby_description}
        #{versions_text}; io-event selector #{@probe.is_a?(Isolated::Failure) ? "unknown (#{@probe})" : @probe.neverblock_selector}
        #{PostgresServer.driver_description}; server: #{PostgresServer.description}; #{Pgbench.version || 'no pgbench here'}
        #{Machine.description}; server and client on the same machine
        Each measurement runs in a forked process, connected and warmed up before timing; medians of several runs.
        load average at start: #{Machine.load_average}
      TEXT
    end

    # --- part 1: long and short queries -----------------------------------

    def cells
      @options[:ratios].product(@options[:longs])
    end

    def measure_long_short
      rows = cells.flat_map do |ratio, longs|
        %w[blocking neverblock].map { |variant| { variant: variant, ratio: ratio, longs: longs, runs: [], failures: [] } }
      end
      @options[:runs].times do |run|
        rows.each do |row|
          outcome = Isolated.run(timeout: long_short_timeout(row)) { long_short_once(row[:variant], row[:longs], row[:ratio]) }
          record(row, outcome)
          warn "  long/short #{row[:longs]} x 1/#{row[:ratio]} #{row[:variant]}, run #{run + 1}: #{outcome_text(outcome)}"
        end
      end
      rows
    end

    # Seconds before a long/short child is killed: the blocking time, with room.
    def long_short_timeout(row)
      30 + (row[:longs] * @options[:long_seconds] * 4) + (row[:longs] * row[:ratio] * 0.01)
    end

    # One run of a cell, in the child.
    # @return [Float] seconds
    def long_short_once(variant, longs, ratio)
      long_sql = format("select pg_sleep(%.3f)", @options[:long_seconds])
      if variant == "blocking"
        conn = PG.connect(**conninfo)
        WARM_UP.times { conn.exec(SHORT_SQL) }
        seconds = timed do
          longs.times do
            conn.exec(long_sql)
            ratio.times { conn.exec(SHORT_SQL) }
          end
        end
        conn.close
        return seconds
      end

      require "neverblock/postgres"
      db = NeverBlock::Postgres.pool(size: @options[:pool_size], **conninfo)
      seconds = NeverBlock.run do
        warm_up(db)
        timed do
          tasks = []
          longs.times do
            tasks << NeverBlock.spawn { db.exec(long_sql) }
            ratio.times { tasks << NeverBlock.spawn { db.exec(SHORT_SQL) } }
          end
          NeverBlock.wait_all(tasks)
        end
      end
      db.close
      seconds
    end

    # Opens every connection of the pool and runs WARM_UP queries, outside
    # the timing. Opening costs milliseconds of CPU on both sides (SCRAM
    # authentication), so a connection opened while the clock runs would
    # count. The opening queries take long enough that each task holds a
    # connection of its own (or, pipelined, that every lane is busy).
    def warm_up(db, fibers: @options[:fibers])
      NeverBlock.wait_all(Array.new([fibers, @options[:pool_size]].max) { NeverBlock.spawn { db.exec(OPEN_SQL) } })
      fan_out(db, WARM_UP, fibers)
    end

    # --- part 2: all short ------------------------------------------------------

    def short_variants
      fibers = @options[:fibers]
      variants = [
        Variant.new(name: "blocking", label: "blocking: one connection, in order", short_label: "blocking",
                    kind: :ruby, measure: -> { blocking_short }),
        Variant.new(name: "blocking_awake", label: "blocking, CPUs kept awake (see below)", short_label: "blocking*",
                    kind: :ruby, measure: -> { Spinner.awake { blocking_short } }),
        Variant.new(name: "threads", label: "#{@options[:threads]} threads, a connection each",
                    short_label: "#{@options[:threads]} threads", kind: :ruby, measure: -> { threads_short }),
        Variant.new(name: "pool", label: "NeverBlock pool(size: #{@options[:pool_size]}), #{fibers} fibers",
                    short_label: "pool #{@options[:pool_size]}", kind: :ruby,
                    measure: -> { neverblock_short(@options[:pool_size], false) })
      ]
      variants += @options[:pipeline_sizes].map do |size|
        Variant.new(name: "pipeline#{size}", label: "NeverBlock pool(size: #{size}, pipeline: true), #{fibers} fibers",
                    short_label: "pipelined #{size}", kind: :ruby, measure: -> { neverblock_short(size, true) })
      end
      variants << Variant.new(name: "raw_pipeline",
                              label: "pg pipeline mode by hand, no scheduler (1 connection, #{@options[:pipeline_depth]} in flight)",
                              short_label: "pg pipeline", kind: :ruby, measure: -> { raw_pipeline_short })
      variants + pgbench_variants
    end

    def pgbench_variants
      variants = %w[extended prepared].product(@options[:pgbench_clients]).flat_map do |mode, clients|
        name = "pgbench_#{mode}_#{clients}"
        label = "pgbench -M #{mode}, #{clients} client#{'s' if clients > 1}"
        short_label = "#{mode == 'extended' ? 'ext.' : 'prep.'} #{clients}c"
        measure = -> { pgbench_short(PGBENCH_SCRIPT, 1, mode, clients) }
        plain = Variant.new(name: name, label: label, short_label: short_label, kind: :pgbench, measure: measure)
        next [plain] if clients > 1

        [plain, Variant.new(name: "#{name}_awake", label: "#{label}, CPUs kept awake", short_label: "#{short_label}*",
                            kind: :pgbench, measure: -> { Spinner.awake(&measure) })]
      end
      depth = @options[:pipeline_depth]
      script = "\\set x random(1, 1000)\n\\startpipeline\n#{"select :x;\n" * depth}\\endpipeline\n"
      variants << Variant.new(name: "pgbench_pipeline", kind: :pgbench, short_label: "pipelined 1c",
                              label: "pgbench -M extended, 1 client, pipelined (#{depth} per \\startpipeline)",
                              measure: -> { pgbench_short(script, depth, "extended", 1) })
    end

    def measure_short
      variants = short_variants
      pgbench = Pgbench.executable
      rows = variants.map { |variant| { variant: variant, runs: [], failures: [], skipped: nil } }
      rows.each { |row| row[:skipped] = "no pgbench here" if row[:variant].kind == :pgbench && pgbench.nil? }
      @options[:short_runs].times do |run|
        rows.each do |row|
          next if row[:skipped]

          outcome = Isolated.run(timeout: 120) { row[:variant].measure.call }
          record(row, outcome)
          warn "  #{@options[:queries]} short, #{row[:variant].name}, run #{run + 1}: #{outcome_text(outcome)}"
        end
      end
      rows
    end

    def blocking_short
      conn = PG.connect(**conninfo)
      WARM_UP.times { |i| conn.exec_params(PARAM_SQL, [i]) }
      measured = timed_with_cpu { @options[:queries].times { |i| conn.exec_params(PARAM_SQL, [i]) } }
      conn.close
      measured
    end

    def threads_short
      conns = Array.new(@options[:threads]) { PG.connect(**conninfo) }
      conns.each { |conn| (WARM_UP / conns.size).times { |i| conn.exec_params(PARAM_SQL, [i]) } }
      shares = split(@options[:queries], conns.size)
      measured = timed_with_cpu do
        conns.zip(shares).map { |conn, share| Thread.new { share.times { |i| conn.exec_params(PARAM_SQL, [i]) } } }
             .each(&:join)
      end
      conns.each(&:close)
      measured
    end

    def neverblock_short(size, pipeline)
      require "neverblock/postgres"
      db = NeverBlock::Postgres.pool(size: size, pipeline: pipeline, **conninfo)
      measured = NeverBlock.run do
        warm_up(db)
        timed_with_cpu { fan_out(db, @options[:queries], @options[:fibers]) }
      end
      db.close
      measured
    end

    # `count` exec_params spread over `fibers` tasks, each running its share
    # in order.
    def fan_out(db, count, fibers)
      tasks = split(count, fibers).map do |share|
        NeverBlock.spawn { share.times { |i| db.exec_params(PARAM_SQL, [i]) } }
      end
      NeverBlock.wait_all(tasks)
    end

    # The protocol NeverBlock's pipelined lanes speak (each statement with
    # its own sync point, a burst written in one flush), without a scheduler
    # or fibers: `depth` statements sent, then their results read.
    def raw_pipeline_short
      conn = PG.connect(**conninfo)
      WARM_UP.times { |i| conn.exec_params(PARAM_SQL, [i]) }
      conn.enter_pipeline_mode
      # pg flushes after every send on its nonblocking connections unless
      # told not to (a private setter; NeverBlock::Postgres::Lane does the same).
      conn.send(:flush_data=, false) if conn.respond_to?(:flush_data=, true)
      depth = @options[:pipeline_depth]
      measured = timed_with_cpu do
        split(@options[:queries], (@options[:queries].to_f / depth).ceil).each do |batch|
          batch.times do |i|
            conn.send_query_params(PARAM_SQL, [i])
            conn.respond_to?(:send_pipeline_sync) ? conn.send_pipeline_sync : conn.pipeline_sync
          end
          conn.socket_io.wait_writable until conn.flush
          batch.times { read_pipelined(conn) }
        end
      end
      conn.close
      measured
    end

    # One statement's result, its end (nil) and its sync point.
    def read_pipelined(conn)
      result = conn.get_result
      result.check
      result.clear
      raise "pipeline out of step" unless conn.get_result.nil?

      sync = conn.get_result
      raise "pipeline out of step: no sync" unless sync&.result_status == PG::PGRES_PIPELINE_SYNC
    end

    # @return [Hash] :seconds pgbench would take for --queries statements
    #   (from its tps, without connecting); :cpu nil (not measured)
    def pgbench_short(script, statements_per_transaction, mode, clients)
      transactions = [@options[:queries] / statements_per_transaction / clients, 1].max
      result = Pgbench.run(script, mode: mode, clients: clients, transactions: transactions,
                                   env: PostgresServer.libpq_env)
      { seconds: @options[:queries] / (result.tps * statements_per_transaction), cpu: nil }
    end

    # --- helpers -------------------------------------------------------------

    # @return [Array<Integer>] `total` split into `parts` shares that differ by at most 1
    def split(total, parts)
      Array.new(parts) { |i| (total / parts) + (i < total % parts ? 1 : 0) }.reject(&:zero?)
    end

    def timed
      started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      yield
      Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
    end

    # @return [Hash] :seconds of wall time, :cpu seconds this process used
    #   (user + system, all its threads) meanwhile
    def timed_with_cpu(&block)
      before = Process.times
      allocated = GC.stat(:total_allocated_objects)
      seconds = timed(&block)
      after = Process.times
      { seconds: seconds, cpu: (after.utime - before.utime) + (after.stime - before.stime),
        allocations: GC.stat(:total_allocated_objects) - allocated }
    end

    # A run's seconds go to row[:runs]; its CPU seconds, when measured, to row[:cpu].
    def record(row, outcome)
      return row[:failures] << outcome.to_s if outcome.is_a?(Isolated::Failure)

      if outcome.is_a?(Hash)
        row[:runs] << outcome[:seconds]
        (row[:cpu] ||= []) << outcome[:cpu] if outcome[:cpu]
        (row[:allocations] ||= []) << outcome[:allocations] if outcome[:allocations]
      else
        row[:runs] << outcome
      end
    end

    def outcome_text(outcome)
      return "FAILED #{outcome}" if outcome.is_a?(Isolated::Failure)
      return format("%.3f s", outcome) unless outcome.is_a?(Hash)

      text = format("%.3f s", outcome[:seconds])
      text += format(", client CPU %.1f us/query", outcome[:cpu] * 1e6 / @options[:queries]) if outcome[:cpu]
      text
    end

    # @return [Float, nil] median Ruby objects allocated per query
    def allocations_per_query(row)
      allocations = Samples.new(row[:allocations] || []).median
      allocations && allocations.to_f / @options[:queries]
    end

    # @return [Float, nil] median client CPU per query, microseconds
    def cpu_per_query(row)
      cpu = Samples.new(row[:cpu] || []).median
      cpu && cpu * 1e6 / @options[:queries]
    end

    def median(row)
      Samples.new(row[:runs]).median
    end

    def rate(row)
      seconds = median(row)
      seconds&.positive? ? @options[:queries] / seconds : nil
    end

    # --- reporting -------------------------------------------------------------

    def report(long_short, short)
      puts "\nload average at end: #{Machine.load_average}"
      report_long_short(long_short) unless long_short.empty?
      report_short(short) unless short.empty?
      failures = (long_short + short).flat_map { |row| row[:failures] }.uniq
      puts "\nfailed runs: #{failures.join('; ')}" unless failures.empty?
      FileUtils.mkdir_p(@options[:out])
      csv = write_csv(long_short, short)
      svg = write_svg(long_short, short)
      puts "\nwrote #{CommandLine.relative(csv)} and #{CommandLine.relative(svg)}"
    end

    def report_long_short(rows)
      puts "\nLong and short queries: each of L iterations issues one `select pg_sleep(#{@options[:long_seconds]})` " \
           "and M `select 1`."
      puts "Blocking: one PG::Connection, in order. NeverBlock: a task per query (NeverBlock.spawn), all at once, " \
           "NeverBlock::Postgres.pool(size: #{@options[:pool_size]})."
      puts "Seconds, median of #{@options[:runs]} runs; advantage = (blocking - NeverBlock) / blocking. " \
           "2009: Ruby 1.9.1, a pool of 50 fibers over 12 connections."
      table = Table.new(["shorts per long", "long", "short", "blocking s", "NeverBlock s", "advantage",
                         "2009 blocking s", "2009 non-blocking s", "2009 advantage", ">= 2009?"])
      cells.each do |ratio, longs|
        blocking, neverblock = %w[blocking neverblock].map do |variant|
          rows.find { |row| row[:variant] == variant && row[:ratio] == ratio && row[:longs] == longs }
        end
        ours = advantage(blocking, neverblock)
        old_blocking, old_nonblocking, old_advantage = RESULTS_2009[[ratio, longs]]
        table << ["1/#{ratio}", longs, longs * ratio, seconds_text(blocking), seconds_text(neverblock),
                  ours ? format("%.1f%%", ours) : "-", old_blocking, old_nonblocking,
                  old_advantage ? format("%.2f%%", old_advantage) : "-",
                  ours && old_advantage ? (ours >= old_advantage ? "yes" : "NO") : "-"]
      end
      puts table
      spread = rows.select { |row| row[:runs].size > 1 }.map do |row|
        (row[:runs].max - row[:runs].min) / row[:runs].min * 100
      end
      puts format("Runs of a cell differed by at most %.0f%% (median %.0f%%).", spread.max, Samples.new(spread).median) unless spread.empty?
    end

    # @return [Float, nil] percent
    def advantage(blocking, neverblock)
      slow = median(blocking)
      fast = median(neverblock)
      slow && fast ? (slow - fast) / slow * 100 : nil
    end

    def seconds_text(row)
      value = median(row)
      value ? format("%.3f", value) : "failed"
    end

    def report_short(rows)
      puts "\nAll short: #{@options[:queries]} `select $1` with an integer parameter (exec_params; pgbench: " \
           "`\\set x random(1, 1000)` + `select :x;`)."
      puts "Median of #{@options[:short_runs]} runs, every run listed (seconds); queries/s from the median. " \
           "pgbench: its tps without connection time."
      blocking = rows.find { |row| row[:variant].name == "blocking" }
      blocking_awake = rows.find { |row| row[:variant].name == "blocking_awake" }
      table = Table.new(["client", "median s", "queries/s", "vs blocking", "client CPU us/query", "CPU vs blocking",
                         "allocations/query", "runs, s"])
      blocking_cpu = blocking && cpu_per_query(blocking)
      rows.each do |row|
        if row[:skipped] || row[:runs].empty?
          table << [row[:variant].label, "n/a", "", "", "", "", "", row[:skipped] || row[:failures].first.to_s]
          next
        end
        cpu = cpu_per_query(row)
        allocations = allocations_per_query(row)
        table << [row[:variant].label, format("%.3f", median(row)), format("%.0f", rate(row)),
                  blocking && rate(blocking) ? format("%.2fx", rate(row) / rate(blocking)) : "",
                  cpu ? format("%.1f", cpu) : "", cpu && blocking_cpu ? format("%.2fx", cpu / blocking_cpu) : "",
                  allocations ? format("%.1f", allocations) : "", Samples.new(row[:runs]).to_s(digits: 3)]
      end
      puts table
      puts "client CPU: user + system time of the Ruby process while it ran the queries, median; " \
           "the server's backends share the same #{Etc.nprocessors} CPUs."
      puts "CPUs kept awake: with a busy-looping nice-19 process per CPU but one (bench/support/spinner.rb). " \
           "A client that waits for each reply pays, on an otherwise idle VM, for waking a halted virtual CPU " \
           "twice per round trip; this shows it without that."
      puts targets(rows, blocking, blocking_awake)
      puts cost_targets(rows, blocking)
    end

    # Issue 13's targets on the client's cost, each against the same run's
    # blocking client (medians): the unpipelined pool's CPU per query and
    # its queries/s against the threads', every pipelined pool's CPU.
    def cost_targets(rows, blocking)
      blocking_cpu = blocking && cpu_per_query(blocking)
      return "\nClient cost targets: not measured (no blocking run with CPU times)." unless blocking_cpu

      pool = rows.find { |row| row[:variant].name == "pool" }
      threads = rows.find { |row| row[:variant].name == "threads" }
      pipelined = rows.select { |row| row[:variant].name.start_with?("pipeline") }
      lines = [format("\nClient cost targets (CPU per query against blocking's %.1f us, same run):", blocking_cpu)]
      lines << cpu_target_line(pool, blocking_cpu, TARGET_POOL_CPU) if pool
      if pool && threads && rate(pool) && rate(threads)
        share = rate(pool) / rate(threads)
        lines << format("Target: #{pool[:variant].label} >= #{threads[:variant].label} in queries/s: " \
                        "%.0f vs %.0f (%.2fx), %s.", rate(pool), rate(threads), share, share >= 1 ? "met" : "NOT met")
      end
      pipelined.each { |row| lines << cpu_target_line(row, blocking_cpu, TARGET_PIPELINED_CPU) }
      lines.join("\n")
    end

    def cpu_target_line(row, blocking_cpu, limit)
      cpu = cpu_per_query(row)
      return "Target: #{row[:variant].label} CPU <= #{limit}x blocking: not measured." unless cpu

      format("Target: %s CPU <= %.1fx blocking: %.1f us/query, %.2fx (%.1f allocations/query), %s.",
             row[:variant].label, limit, cpu, cpu / blocking_cpu, allocations_per_query(row) || Float::NAN,
             cpu <= limit * blocking_cpu ? "met" : "NOT met")
    end

    def targets(rows, blocking, blocking_awake)
      pipelined = rows.select { |row| row[:variant].name.start_with?("pipeline") && rate(row) }
      return "" if pipelined.empty?

      best = pipelined.max_by { |row| rate(row) }
      lines = ["\nBest pipelined: #{best[:variant].label}, #{format('%.0f', rate(best))} queries/s " \
               "(#{pipelined.map { |row| "size #{row[:variant].name[/\d+/]}: #{format('%.0f', rate(row))}" }.join(', ')})."]
      if blocking && rate(blocking)
        ratio = rate(best) / rate(blocking)
        lines << format("Target: pipelined >= %.0fx blocking: %.2fx, %s.", TARGET_VS_BLOCKING, ratio,
                        ratio >= TARGET_VS_BLOCKING ? "met" : "NOT met")
      end
      if blocking_awake && rate(blocking_awake)
        ratio = rate(best) / rate(blocking_awake)
        lines << format("  against blocking with the CPUs kept awake: %.2fx, %s.", ratio,
                        ratio >= TARGET_VS_BLOCKING ? "met" : "NOT met")
      end
      pgbench = rows.select { |row| row[:variant].kind == :pgbench && row[:variant].name != "pgbench_pipeline" && rate(row) }
      if pgbench.empty?
        lines << "Target: pipelined >= #{(TARGET_VS_PGBENCH * 100).round}% of pgbench's best: not measured here (no pgbench)."
      else
        top = pgbench.max_by { |row| rate(row) }
        share = rate(best) / rate(top)
        lines << format("Target: pipelined >= %.0f%% of pgbench's best (%s, %.0f queries/s): %.0f%%, %s.",
                        TARGET_VS_PGBENCH * 100, top[:variant].label, rate(top), share * 100,
                        share >= TARGET_VS_PGBENCH ? "met" : "NOT met")
      end
      lines.join("\n")
    end

    def write_csv(long_short, short)
      headers = %w[part variant label longs shorts queries runs median_s min_s max_s queries_per_s
                   client_cpu_us_per_query allocations_per_query advantage_pct advantage_2009_pct note]
      rows = long_short.map do |row|
        samples = Samples.new(row[:runs])
        partner = long_short.find do |other|
          other[:ratio] == row[:ratio] && other[:longs] == row[:longs] && other[:variant] == "blocking"
        end
        ours = row[:variant] == "neverblock" ? advantage(partner, row) : nil
        ["longshort", row[:variant], nil, row[:longs], row[:longs] * row[:ratio],
         row[:longs] * (row[:ratio] + 1), samples.to_s(digits: 4), samples.median&.round(4), samples.min&.round(4),
         samples.max&.round(4), nil, nil, nil, ours&.round(2),
         (RESULTS_2009[[row[:ratio], row[:longs]]]&.last if row[:variant] == "neverblock"),
         row[:failures].first]
      end
      rows += short.map do |row|
        samples = Samples.new(row[:runs])
        ["short", row[:variant].name, row[:variant].label, nil, @options[:queries], @options[:queries],
         samples.to_s(digits: 4), samples.median&.round(4), samples.min&.round(4), samples.max&.round(4),
         rate(row)&.round(0), cpu_per_query(row)&.round(2), allocations_per_query(row)&.round(1), nil, nil,
         row[:skipped] || row[:failures].first]
      end
      CsvFile.write(File.join(@options[:out], "db.csv"), headers, rows)
    end

    def write_svg(long_short, short)
      chart = SvgChart.new(title: "NeverBlock and PostgreSQL",
                           subtitle: ["ruby #{RUBY_VERSION}, #{versions_text}, #{PostgresServer.driver_description}",
                                      "#{Machine.description}; server on the same machine",
                                      "long/short: a task per query, pool of #{@options[:pool_size]}; " \
                                      "* = CPUs kept awake by a nice-19 busy loop"])
      @options[:longs].each do |longs|
        next if long_short.empty?

        series = { "2009 advantage (Ruby 1.9.1)" => [], "NeverBlock advantage" => [] }
        @options[:ratios].each do |ratio|
          series["2009 advantage (Ruby 1.9.1)"] << RESULTS_2009[[ratio, longs]]&.last
          pair = %w[blocking neverblock].map do |variant|
            long_short.find { |row| row[:variant] == variant && row[:ratio] == ratio && row[:longs] == longs }
          end
          ours = advantage(*pair)
          series["NeverBlock advantage"] << (ours.nil? || ours.negative? ? (ours ? format("%.0f%%", ours) : "failed") : ours)
        end
        chart.add_panel(title: "#{longs} long queries, time saved vs blocking, % (higher is better)",
                        categories: @options[:ratios].map { |ratio| "1/#{ratio}" }, series: series)
      end
      unless short.empty?
        %i[ruby pgbench].each do |kind|
          rows = short.select { |row| row[:variant].kind == kind }
          title = kind == :ruby ? "#{@options[:queries]} select $1 from Ruby, queries/s" : "pgbench (C) on the same query, queries/s"
          chart.add_panel(title: "#{title} (median; higher is better)", categories: rows.map { |row| row[:variant].short_label },
                          series: { "queries/s" => rows.map { |row| rate(row) || (row[:skipped] ? "n/a" : "failed") } })
        end
        rows = short.select { |row| row[:variant].kind == :ruby }
        chart.add_panel(title: "Ruby client's CPU per query, us (median; lower is better)",
                        categories: rows.map { |row| row[:variant].short_label },
                        series: { "client CPU us/query" => rows.map { |row| cpu_per_query(row) || "failed" } })
      end
      chart.write(File.join(@options[:out], "db.svg"))
    end
  end
end

if $PROGRAM_NAME == __FILE__
  options = {}
  integers = ->(list) { list.map { |value| Integer(value.delete("_")) } }
  parser = OptionParser.new do |opts|
    opts.banner = "Usage: ruby bench/db.rb [options]"
    opts.on("--longs LIST", Array, "long queries per cell (10,50,100)") { |list| options[:longs] = integers.call(list) }
    opts.on("--ratios LIST", Array, "short queries per long one (2,5,10,20,50,100)") do |list|
      options[:ratios] = integers.call(list)
    end
    opts.on("--long-seconds SECONDS", Float, "pg_sleep of a long query (0.05)") { |value| options[:long_seconds] = value }
    opts.on("--pool-size N", Integer, "NeverBlock pool size for the unpipelined runs (12)") do |value|
      options[:pool_size] = value
    end
    opts.on("--runs N", Integer, "runs per long/short cell, median reported (3)") { |value| options[:runs] = value }
    opts.on("--queries N", Integer, "short queries per all-short run (10000)") do |value|
      options[:queries] = Integer(value)
    end
    opts.on("--fibers N", Integer, "fibers issuing the short queries (100)") { |value| options[:fibers] = value }
    opts.on("--threads N", Integer, "threads (a connection each) in the all-short peer (12)") do |value|
      options[:threads] = value
    end
    opts.on("--pipeline-sizes LIST", Array, "pool sizes with pipeline: true (2,4,12)") do |list|
      options[:pipeline_sizes] = integers.call(list)
    end
    opts.on("--pgbench-clients LIST", Array, "pgbench -c values (1,12)") do |list|
      options[:pgbench_clients] = integers.call(list)
    end
    opts.on("--short-runs N", Integer, "runs per all-short client, median reported (5)") do |value|
      options[:short_runs] = value
    end
    NeverBlockBench::CommandLine.shared_options(opts, options, results: "db", variants: "longshort,short (the parts)")
  end
  NeverBlockBench::CommandLine.run(parser) { NeverBlockBench::DbBench.new(options).call }
end
