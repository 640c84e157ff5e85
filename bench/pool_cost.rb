#!/usr/bin/env ruby
# frozen_string_literal: true

# Where a pooled query's CPU goes: the client's CPU and allocations per
# `select $1`, layer by layer: blocking (PG::Connection, also with the other
# CPUs kept busy: blocking_awake), sched (a NeverBlock::Postgres::Connection
# in one fiber), pool1 (pool(size: 1), one fiber), pool12 (size 12, 12
# fibers: as many fibers and connections as pool's, no waiting in line), pool
# (size 12, 100 fibers), pipeline (the same, pipelined). Each measurement is a forked child
# that connects and warms up first; interleaved rounds, medians.
#
#   bench/run pool_cost                       Ruby 3.1 -> bench/results/pool_cost.{txt,csv}
#   bench/run --ruby 3.4-yjit pool_cost       Ruby 3.4 + YJIT -> bench/results/ruby34-yjit/
#   bench/run pool_cost --only pool,blocking --queries 100000 --runs 3
#   bench/run pool_cost --quick               smoke run: 500 queries, one round
#   POOL_COST_STACKPROF=DIR   a stackprof dump per variant and run (stackprof: development bundles only)
#   --queries-only            each variant once, unmeasured (for strace -c -f or perf)

require_relative "support/harness"
require_relative "support/postgres"

module NeverBlockBench
  class PoolCostBench < Bench
    DEFAULTS = { queries: 10_000, runs: 5, queries_only: false }.freeze
    QUICK = { queries: 500, runs: 1 }.freeze
    ONLY = %w[blocking blocking_awake sched pool1 pool12 pool pipeline].freeze # the variants
    SQL = PooledQueries::SQL
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
      when "pool12", "pool", "pipeline"
        db = NeverBlock::Postgres.pool(size: POOL_SIZE, pipeline: name == "pipeline", **@conninfo)
        fibers = name == "pool12" ? POOL_SIZE : FIBERS
        NeverBlock.run do
          PooledQueries.open_all(db, fibers)
          measure(name, queries) { |count| PooledQueries.fan_out(db, count, fibers) }
        end
      end
    end

    # Runs the block with WARM_UP, then, measured, with `queries`; under the
    # scheduler also counts the fibers it entered (Scheduler#switches).
    def measure(name, queries)
      yield PooledQueries::WARM_UP
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
