#!/usr/bin/env ruby
# frozen_string_literal: true

# Where a pooled query's CPU goes: the client's CPU and allocations per
# `select $1` (exec_params), layer by layer.
#
#   blocking   PG::Connection#exec_params, no scheduler
#   sched      the same on one NeverBlock::Postgres::Connection, one fiber
#              under NeverBlock's scheduler (the scheduler's cost)
#   pool1      NeverBlock::Postgres.pool(size: 1), one fiber (checkout, checkin)
#   pool       pool(size: 12), 100 fibers (the benchmark's case: waiting for
#              a connection, handing over)
#   pipeline   pool(size: 12, pipeline: true), 100 fibers
#
#   bin/databases run bundle exec ruby -Ilib bench/pool_cost.rb [--queries N] [--runs N] [VARIANT...]
#   POOL_COST_STACKPROF=DIR   also write a stackprof (cpu mode) dump per variant to DIR
#   POOL_COST_QUERIES_ONLY=1  run each variant once, print nothing but its pid (for strace -c)
#
# Each measurement is a forked child that connects and warms up first;
# variants are interleaved round by round and medians printed with every run.

require "optparse"
require "pg"
require_relative "support/postgres"
require "neverblock"
require "neverblock/postgres"

module PoolCost
  SQL = "select $1"
  WARM_UP = 500
  VARIANTS = %w[blocking sched pool1 pool pipeline].freeze

  module_function

  def conninfo = NeverBlockBench::PostgresServer.conninfo

  def cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)

  # Runs `queries` exec_params through `run` (a lambda of count), measured
  # after a warm-up; returns [cpu us/query, allocations/query, GC runs per 1000 queries].
  def measure(queries, name)
    yield WARM_UP
    GC.start
    allocated = GC.stat(:total_allocated_objects)
    runs = GC.count
    started = cpu
    profile(name) { yield queries }
    [(cpu - started) * 1e6 / queries, (GC.stat(:total_allocated_objects) - allocated).fdiv(queries),
     (GC.count - runs) * 1000.0 / queries]
  end

  def profile(name, &block)
    return yield unless (dir = ENV["POOL_COST_STACKPROF"])

    require "stackprof"
    StackProf.run(mode: :cpu, interval: 100, raw: true, out: File.join(dir, "#{name}.dump"), &block)
  end

  def spread(db, count, fibers)
    per, extra = count.divmod(fibers)
    tasks = Array.new(fibers) { |f| NeverBlock.spawn { (per + (f < extra ? 1 : 0)).times { |i| db.exec_params(SQL, [i]) } } }
    NeverBlock.wait_all(tasks)
  end

  def run_variant(name, queries)
    case name
    when "blocking"
      conn = PG.connect(**conninfo)
      measure(queries, name) { |n| n.times { |i| conn.exec_params(SQL, [i]) } }
    when "sched"
      NeverBlock.run do
        conn = NeverBlock::Postgres::Connection.new(**conninfo)
        measure(queries, name) { |n| n.times { |i| conn.exec_params(SQL, [i]) } }
      end
    when "pool1"
      db = NeverBlock::Postgres.pool(size: 1, **conninfo)
      NeverBlock.run { measure(queries, name) { |n| n.times { |i| db.exec_params(SQL, [i]) } } }
    when "pool", "pipeline"
      db = NeverBlock::Postgres.pool(size: 12, pipeline: name == "pipeline", **conninfo)
      NeverBlock.run do
        # every connection opened first (a long query each holds one)
        NeverBlock.wait_all(Array.new(100) { NeverBlock.spawn { db.exec("select pg_sleep(0.02)") } })
        measure(queries, name) { |n| spread(db, n, 100) }
      end
    else abort "unknown variant #{name}"
    end
  end

  def in_child(name, queries)
    reader, writer = IO.pipe
    pid = fork do
      reader.close
      writer.write(Marshal.dump(run_variant(name, queries)))
      writer.close
      exit!(0)
    end
    writer.close
    result = reader.read
    Process.wait(pid)
    result.empty? ? nil : Marshal.load(result) # rubocop:disable Security/MarshalLoad -- our own child
  end

  def median(values)
    sorted = values.compact.sort
    sorted.empty? ? nil : (sorted[(sorted.size - 1) / 2] + sorted[sorted.size / 2]) / 2.0
  end

  def main(argv)
    options = { queries: 10_000, runs: 5 }
    OptionParser.new do |o|
      o.on("--queries N", Integer) { |v| options[:queries] = v }
      o.on("--runs N", Integer) { |v| options[:runs] = v }
    end.parse!(argv)
    variants = argv.empty? ? VARIANTS : argv
    if ENV["POOL_COST_QUERIES_ONLY"]
      variants.each { |name| run_variant(name, options[:queries]) }
      return
    end
    results = variants.to_h { |name| [name, []] }
    options[:runs].times { variants.each { |name| results[name] << in_child(name, options[:queries]) } }
    base = median(results["blocking"]&.map(&:first) || [])
    puts "#{RUBY_DESCRIPTION}; #{options[:queries]} queries x #{options[:runs]} runs; load #{File.read('/proc/loadavg').split[0, 3].join(' ')}"
    puts format("%-10s %9s %8s %9s %8s  %s", "variant", "cpu_us/q", "x_block", "allocs/q", "gc/1000q", "runs (cpu us/q)")
    results.each do |name, runs|
      us = median(runs.map(&:first))
      puts format("%-10s %9.2f %8s %9.1f %8.2f  %s", name, us, base ? format("%.2f", us / base) : "", median(runs.map { _1[1] }),
                  median(runs.map(&:last)),
                  runs.map { |r| r.first.round(1) }.join(" "))
    end
  end
end

PoolCost.main(ARGV) if $PROGRAM_NAME == __FILE__
