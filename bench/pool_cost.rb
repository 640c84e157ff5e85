#!/usr/bin/env ruby
# frozen_string_literal: true

# Where a pooled query's CPU goes: the client's CPU and allocations per
# `select $1` (exec_params), layer by layer.
#
#   blocking   PG::Connection#exec_params, no scheduler
#   blocking_awake  the same with the other CPUs kept busy (Spinner, see bench/db.rb):
#              a client that waits for every reply pays for waking a halted virtual
#              CPU, which on a quiet machine inflates blocking's CPU per query
#   sched      the same on one NeverBlock::Postgres::Connection, one fiber
#              under NeverBlock's scheduler (the scheduler's cost)
#   pool1      NeverBlock::Postgres.pool(size: 1), one fiber (checkout, checkin)
#   pool       pool(size: 12), 100 fibers (the benchmark's case: waiting for
#              a connection, handing over)
#   pipeline   pool(size: 12, pipeline: true), 100 fibers
#
#   bench/run pool_cost                       Ruby 3.1 -> bench/results/pool_cost.{txt,csv}
#   bench/run --ruby 3.4-yjit pool_cost       Ruby 3.4 + YJIT -> bench/results/ruby34-yjit/
#   bench/run pool_cost --only pool,blocking --queries 100000 --runs 3
#   bench/run pool_cost --quick               smoke run: 500 queries, one round
#   POOL_COST_STACKPROF=DIR   also write a stackprof (cpu mode) dump per variant and run to DIR
#                             (stackprof is in the development bundles, not the bench ones)
#   --queries-only            run each variant once in this process, measure and print nothing
#                             (for `strace -c -f` or perf around the whole run)
#
# Each measurement is a forked child that connects and warms up first;
# variants are interleaved round by round, and the median printed with
# every run beside it.

require_relative "support/harness"
require_relative "support/postgres"

module NeverBlockBench
  # Measures a pooled query's CPU layer by layer and reports it. See the file comment.
  class PoolCostBench < Bench
    DEFAULTS = { queries: 10_000, runs: 5, queries_only: false }.freeze
    QUICK = { queries: 500, runs: 1 }.freeze
    ONLY = %w[blocking blocking_awake sched pool1 pool pipeline].freeze # the variants
    SQL = "select $1"
    OPEN_SQL = "select pg_sleep(0.02)" # long enough that each warm-up task holds a connection of its own
    WARM_UP = 500 # queries each measurement runs before its clock starts
    FIBERS = 100
    POOL_SIZE = 12

    # @return [Boolean] true when every measurement succeeded
    def call
      return warn(PostgresServer.problem) if PostgresServer.problem

      require "pg"
      require "neverblock"
      require "neverblock/postgres"
      @conninfo = PostgresServer.conninfo
      if @options[:queries_only]
        @options[:only].each { |name| run_variant(name, @options[:queries]) }
        return true
      end

      puts header
      cells = @options[:only].map { |name| Cell.new(name, variant: name) }
      NeverBlockBench.rounds(cells, @options[:runs]) { |cell| run_variant(cell[:variant], @options[:queries]) }
      report(cells)
      cells.none? { |cell| cell.failures.any? }
    end

    private

    def header
      NeverBlockBench.header(
        "NeverBlock pool cost: a pooled query's client CPU, layer by layer",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}), io-event #{IO::Event::VERSION}",
        "#{PostgresServer.driver_description}; server: #{PostgresServer.description}",
        "#{@options[:queries]} `#{SQL}` per run, #{@options[:runs]} runs interleaved, each in a forked child warmed up first"
      )
    end

    # @return [Hash] :seconds, :cpu and :allocations of `queries` queries, and :gc_runs (in the child)
    def run_variant(name, queries)
      case name
      when "blocking"
        conn = PG.connect(**@conninfo)
        measure(name, queries) { |count| count.times { |i| conn.exec_params(SQL, [i]) } }
      when "blocking_awake"
        Spinner.awake { run_variant("blocking", queries) }
      when "sched"
        NeverBlock.run do
          conn = NeverBlock::Postgres::Connection.new(**@conninfo)
          measure(name, queries) { |count| count.times { |i| conn.exec_params(SQL, [i]) } }
        end
      when "pool1"
        db = NeverBlock::Postgres.pool(size: 1, **@conninfo)
        NeverBlock.run { measure(name, queries) { |count| count.times { |i| db.exec_params(SQL, [i]) } } }
      when "pool", "pipeline"
        db = NeverBlock::Postgres.pool(size: POOL_SIZE, pipeline: name == "pipeline", **@conninfo)
        NeverBlock.run do
          NeverBlock.wait_all(Array.new(FIBERS) { NeverBlock.spawn { db.exec(OPEN_SQL) } }) # every connection opened first
          measure(name, queries) { |count| fan_out(db, count) }
        end
      end
    end

    # Runs the block with WARM_UP, then, measured, with `queries`. Under the
    # scheduler also counts the fibers it entered (Scheduler#switches).
    def measure(name, queries)
      yield WARM_UP
      GC.start
      runs = GC.count
      scheduler = Fiber.scheduler
      switches = scheduler&.switches
      outcome = NeverBlockBench.timed_with_cpu { profile(name) { yield queries } }
      outcome.merge(gc_runs: GC.count - runs, switches: switches && (scheduler.switches - switches))
    end

    def profile(name, &block)
      return yield unless (dir = ENV.fetch("POOL_COST_STACKPROF", nil))

      require "stackprof"
      FileUtils.mkdir_p(dir)
      StackProf.run(mode: :cpu, interval: 100, raw: true, out: File.join(dir, "#{name}-#{Process.pid}.dump"), &block)
    end

    # `count` exec_params over FIBERS tasks, each running its share in order.
    def fan_out(db, count)
      NeverBlock.wait_all(NeverBlockBench.split(count, FIBERS).map { |share| NeverBlock.spawn { share.times { |i| db.exec_params(SQL, [i]) } } })
    end

    def report(cells)
      queries = @options[:queries]
      per_query = ->(values) { NeverBlockBench.median(values)&./(queries) }
      blocking = cells.find { |cell| cell[:variant] == "blocking" }
      base = blocking && per_query.call(blocking.cpu)&.*(1e6)
      rows = cells.map do |cell|
        us = per_query.call(cell.cpu)&.*(1e6)
        { "variant" => cell[:variant], "cpu_us/q" => us && format("%.2f", us), "x_block" => (format("%.2f", us / base) if us && base),
          "allocs/q" => per_query.call(cell.allocations)&.then { |value| format("%.1f", value) },
          "gc/1000q" => per_query.call(cell.outcomes.map { |outcome| outcome[:gc_runs] })&.then { |value| format("%.2f", value * 1000) },
          "switches/q" => per_query.call(cell.outcomes.filter_map { |outcome| outcome[:switches] })&.then { |value| format("%.2f", value) },
          "runs (cpu us/q)" => cell.cpu.map { |cpu| (cpu * 1e6 / queries).round(1) }.join(" "), "note" => cell.failures.first }
      end
      puts
      puts Table.of(rows, ["variant", "cpu_us/q", "x_block", "allocs/q", "gc/1000q", "switches/q", "runs (cpu us/q)"])
      puts "switches/q: fibers the scheduler entered per query (Scheduler#switches: a return from a wait, or a task's start)"
      rows.each { |row| puts "#{row['variant']}: #{row['note']}" if row["note"] }
      NeverBlockBench.write_results(@options[:out], "pool_cost", rows)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::PoolCostBench, "pool_cost") if $PROGRAM_NAME == __FILE__
