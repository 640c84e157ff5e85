#!/usr/bin/env ruby
# frozen_string_literal: true

# PostgreSQL through NeverBlock::Postgres: (1) 2009's long and short queries,
# L iterations (--longs) of a pg_sleep(0.05) and M (--ratios) `select 1`, one
# blocking connection in order against a task per query over a pool, with
# 2009's numbers beside; (2) --queries `select $1` (exec_params) by a
# blocking connection (also with the CPUs kept awake), threads, tasks over a
# pool and pipelined pools, pg's pipeline mode by hand, and pgbench (from
# PATH or $PGBENCH): queries/s, the client's CPU and allocations per query.
# Each measurement is a forked child that connects and warms up first;
# --runs (part 1) or --short-runs (part 2) interleaved rounds; medians, every run beside.
#
#   bench/run db                Ruby 3.1 -> bench/results/db.{txt,csv,svg}, a throwaway server
#   bench/run --ruby 3.3 db     Ruby 3.3 -> bench/results/ruby33/
#   bench/run db --quick        smoke run: one round, 10 long queries, 500 short

require_relative "support/harness"
require_relative "support/postgres"

module NeverBlockBench
  class DbBench < Bench
    DEFAULTS = { longs: [10, 50, 100], ratios: [2, 5, 10, 20, 50, 100], long_seconds: 0.05, pool_size: 12, runs: 3,
                 queries: 10_000, fibers: 100, threads: 12, pipeline_sizes: [2, 4, 12], pgbench_clients: [1, 12],
                 pipeline_depth: 100, short_runs: 5 }.freeze
    QUICK = { longs: [10], ratios: [2, 10], runs: 1, queries: 500, short_runs: 1, pipeline_sizes: [2] }.freeze
    ONLY = %w[longshort short].freeze # the parts
    SHORT_SQL = "select 1"
    PARAM_SQL = PooledQueries::SQL
    PGBENCH_SCRIPT = "\\set x random(1, 1000)\nselect :x;\n" # PARAM_SQL with a random integer
    WARM_UP = PooledQueries::WARM_UP
    # 2009 (Ruby 1.9.1): [shorts per long, longs] => [blocking s, non-blocking s, advantage %].
    RESULTS_2009 = {
      [2, 10] => [0.56, 0.5, 10.27], [2, 50] => [2.55, 2.26, 11.19], [2, 100] => [5.15, 4.46, 13.53],
      [5, 10] => [0.55, 0.4, 27.04], [5, 50] => [2.72, 1.83, 32.82], [5, 100] => [5.45, 3.63, 33.39],
      [10, 10] => [0.6, 0.4, 33.76], [10, 50] => [3.01, 1.82, 39.67], [10, 100] => [5.9, 3.65, 38.13],
      [20, 10] => [0.72, 0.45, 38.12], [20, 50] => [3.43, 2.1, 38.73], [20, 100] => [6.83, 4.33, 36.53],
      [50, 10] => [0.98, 0.62, 36.57], [50, 50] => [4.78, 3.23, 32.36], [50, 100] => [9.74, 8.68, 10.93],
      [100, 10] => [1.46, 0.94, 35.4], [100, 50] => [7.42, 5.17, 30.31], [100, 100] => [14.27, 12.68, 11.15]
    }.freeze

    # @return [Boolean] true when every measurement succeeded
    def call
      return warn(PostgresServer.problem) if PostgresServer.problem

      @probe = Peers.start { |probe| header(probe) } or return false
      @conninfo = PostgresServer.conninfo
      long_short = @options[:only].include?("longshort") ? measure_long_short : []
      short = @options[:only].include?("short") ? measure_short : []
      report(long_short, short)
      (long_short + short).none? { |cell| cell.failures.any? }
    end

    private

    def header(probe)
      NeverBlockBench.header(
        "NeverBlock PostgreSQL benchmark: long and short queries (the 2009 table), and short queries against pgbench",
        Peers.text(probe),
        "#{PostgresServer.driver_description}; server: #{PostgresServer.description}; #{Pgbench.version || 'no pgbench here'}",
        "Each measurement runs in a forked process, connected and warmed up before timing; medians of several runs;",
        "server and client on the same machine."
      )
    end

    def measure_long_short
      cells = @options[:ratios].product(@options[:longs]).flat_map do |ratio, longs|
        %w[blocking neverblock].map { |variant| Cell.new("long/short #{longs} x 1/#{ratio} #{variant}", variant: variant, ratio: ratio, longs: longs) }
      end
      timeout = ->(cell) { 30 + (cell[:longs] * @options[:long_seconds] * 4) + (cell[:longs] * cell[:ratio] * 0.01) }
      NeverBlockBench.rounds(cells, @options[:runs], timeout: timeout) { |cell| long_short_once(cell[:variant], cell[:longs], cell[:ratio]) }
    end

    # @return [Float] seconds, in the child
    def long_short_once(variant, longs, ratio)
      long_sql = format("select pg_sleep(%.3f)", @options[:long_seconds])
      if variant == "blocking"
        conn = PG.connect(**@conninfo)
        WARM_UP.times { conn.exec(SHORT_SQL) }
        return NeverBlockBench.timed { longs.times { conn.exec(long_sql) && ratio.times { conn.exec(SHORT_SQL) } } }.tap { conn.close }
      end

      with_pool(@options[:pool_size], false) do |db|
        NeverBlockBench.timed do
          tasks = Array.new(longs) { [NeverBlock.spawn { db.exec(long_sql) }] + Array.new(ratio) { NeverBlock.spawn { db.exec(SHORT_SQL) } } }
          NeverBlock.wait_all(tasks.flatten)
        end
      end
    end

    # Runs the block in NeverBlock.run over a pool whose every connection was opened and warmed up first.
    def with_pool(size, pipeline)
      require "neverblock/postgres"
      db = NeverBlock::Postgres.pool(size: size, pipeline: pipeline, **@conninfo)
      NeverBlock.run do
        PooledQueries.open_all(db, [@options[:fibers], @options[:pool_size]].max)
        fan_out(db, WARM_UP)
        yield db
      end.tap { db.close }
    end

    def fan_out(db, count) = PooledQueries.fan_out(db, count, @options[:fibers])

    # [name, label, measure (in the child: Hash with :seconds)]; the pgbench_* ones need pgbench
    def short_variants
      fibers = @options[:fibers]
      pooled = ->(size, pipeline) { with_pool(size, pipeline) { |db| NeverBlockBench.timed_with_cpu { fan_out(db, @options[:queries]) } } }
      variants = [["blocking", "blocking: one connection, in order", -> { blocking_short }],
                  ["blocking_awake", "blocking, CPUs kept awake (see below)", -> { Spinner.awake { blocking_short } }],
                  ["threads", "#{@options[:threads]} threads, a connection each", -> { threads_short }],
                  ["pool", "NeverBlock pool(size: #{@options[:pool_size]}), #{fibers} fibers", -> { pooled.call(@options[:pool_size], false) }]]
      variants += @options[:pipeline_sizes].map do |size|
        ["pipeline#{size}", "NeverBlock pool(size: #{size}, pipeline: true), #{fibers} fibers", -> { pooled.call(size, true) }]
      end
      variants << ["raw_pipeline", "pg pipeline mode by hand, no scheduler (1 connection, #{@options[:pipeline_depth]} in flight)",
                   -> { raw_pipeline_short }]
      %w[extended prepared].product(@options[:pgbench_clients]).each do |mode, clients|
        name = "pgbench_#{mode}_#{clients}"
        label = "pgbench -M #{mode}, #{clients} client#{'s' if clients > 1}"
        measure = -> { pgbench_short(PGBENCH_SCRIPT, 1, mode, clients) }
        variants << [name, label, measure]
        variants << ["#{name}_awake", "#{label}, CPUs kept awake", -> { Spinner.awake(&measure) }] if clients == 1
      end
      depth = @options[:pipeline_depth]
      script = "\\set x random(1, 1000)\n\\startpipeline\n#{"select :x;\n" * depth}\\endpipeline\n"
      variants << ["pgbench_pipeline", "pgbench -M extended, 1 client, pipelined (#{depth} per \\startpipeline)",
                   -> { pgbench_short(script, depth, "extended", 1) }]
    end

    def measure_short
      cells = short_variants.map do |name, label, measure|
        Cell.new("#{@options[:queries]} short, #{name}", variant: name, label: label, measure: measure,
                                                         skipped: ("no pgbench here" if name.start_with?("pgbench") && !Pgbench.executable))
      end
      NeverBlockBench.rounds(cells, @options[:short_runs]) { |cell| cell[:measure].call }
    end

    def blocking_short
      conn = PG.connect(**@conninfo)
      WARM_UP.times { |i| conn.exec_params(PARAM_SQL, [i]) }
      NeverBlockBench.timed_with_cpu { @options[:queries].times { |i| conn.exec_params(PARAM_SQL, [i]) } }.tap { conn.close }
    end

    def threads_short
      conns = Array.new(@options[:threads]) { PG.connect(**@conninfo) }
      conns.each { |conn| (WARM_UP / conns.size).times { |i| conn.exec_params(PARAM_SQL, [i]) } }
      shares = NeverBlockBench.split(@options[:queries], conns.size)
      NeverBlockBench.timed_with_cpu do
        conns.zip(shares).map { |conn, share| Thread.new { share.times { |i| conn.exec_params(PARAM_SQL, [i]) } } }.each(&:join)
      end.tap { conns.each(&:close) }
    end

    # The protocol of NeverBlock's pipelined lanes (each statement with its own
    # sync point, a burst written in one flush) without a scheduler or fibers.
    def raw_pipeline_short
      conn = PG.connect(**@conninfo)
      WARM_UP.times { |i| conn.exec_params(PARAM_SQL, [i]) }
      conn.enter_pipeline_mode
      # pg flushes after every send on a nonblocking connection unless told not to (a private setter, as in Lane).
      conn.send(:flush_data=, false) if conn.respond_to?(:flush_data=, true)
      NeverBlockBench.timed_with_cpu do
        NeverBlockBench.split(@options[:queries], (@options[:queries].to_f / @options[:pipeline_depth]).ceil).each do |batch|
          batch.times do |i|
            conn.send_query_params(PARAM_SQL, [i])
            conn.respond_to?(:send_pipeline_sync) ? conn.send_pipeline_sync : conn.pipeline_sync
          end
          conn.socket_io.wait_writable until conn.flush
          batch.times do # a result, its end (nil), its sync point
            conn.get_result.tap(&:check).clear
            raise "pipeline out of step" unless conn.get_result.nil? && conn.get_result&.result_status == PG::PGRES_PIPELINE_SYNC
          end
        end
      end.tap { conn.close }
    end

    # @return [Hash] the :seconds pgbench would take for --queries statements (from its tps)
    def pgbench_short(script, per_transaction, mode, clients)
      transactions = [@options[:queries] / per_transaction / clients, 1].max
      tps = Pgbench.run(script, mode: mode, clients: clients, transactions: transactions, env: PostgresServer.libpq_env)
      { seconds: @options[:queries] / (tps * per_transaction) }
    end

    def rate(cell) = cell.median&.positive? ? @options[:queries] / cell.median : nil
    def cpu_us(cell) = NeverBlockBench.median(cell.cpu)&.*(1e6 / @options[:queries])
    def allocations(cell) = NeverBlockBench.median(cell.allocations)&./(@options[:queries])

    def report(long_short, short)
      rows = long_short.empty? ? [] : @options[:ratios].product(@options[:longs]).map { |ratio, longs| long_short_row(long_short, ratio, longs) }
      report_long_short(rows) unless rows.empty?
      blocking = short.find { |cell| cell[:variant] == "blocking" }
      rows += short.map do |cell|
        { "part" => "short", "variant" => cell[:variant], "label" => cell[:label], "queries" => @options[:queries],
          "median_s" => cell.median&.round(4), "queries_per_s" => rate(cell)&.round, "vs_blocking" => ratio(rate(cell), blocking && rate(blocking)),
          "cpu_us_per_query" => cpu_us(cell)&.round(1), "cpu_vs_blocking" => ratio(cpu_us(cell), blocking && cpu_us(blocking)),
          "allocations_per_query" => allocations(cell)&.round(1), "runs_s" => cell.listing(4), "note" => cell.skipped || cell.failures.first }
      end
      report_short(rows.select { |row| row["part"] == "short" }) unless short.empty?
      NeverBlockBench.write_results(@options[:out], "db", rows, chart)
    end

    # Blocking's and NeverBlock's medians for `longs` iterations with `ratio` shorts each, the
    # advantage (percent of blocking's time NeverBlock saved), and 2009's.
    def long_short_row(cells, ratio, longs)
      blocking, ours = %w[blocking neverblock].map { |v| cells.find { |c| c[:variant] == v && c[:ratio] == ratio && c[:longs] == longs } }
      slow, fast = blocking.median, ours.median
      old_blocking, old_nonblocking, old = RESULTS_2009[[ratio, longs]]
      { "part" => "longshort", "label" => "1/#{ratio}", "longs" => longs, "queries" => longs * (ratio + 1),
        "blocking_s" => slow&.round(3), "neverblock_s" => fast&.round(3), "advantage_pct" => (((slow - fast) / slow * 100).round(1) if slow && fast),
        "2009_blocking_s" => old_blocking, "2009_non_blocking_s" => old_nonblocking, "2009_advantage_pct" => old,
        "runs_s" => "#{blocking.listing(3)}; #{ours.listing(3)}", "note" => (blocking.failures + ours.failures).first }
    end

    def ratio(value, base) = value && base ? (value / base).round(2) : nil

    def report_long_short(rows)
      puts "\nLong and short queries: each of L iterations issues one `select pg_sleep(#{@options[:long_seconds]})` and M `select 1`."
      puts "Blocking: one PG::Connection, in order. NeverBlock: a task per query (NeverBlock.spawn), all at once, " \
           "NeverBlock::Postgres.pool(size: #{@options[:pool_size]})."
      puts "Seconds, median of #{@options[:runs]} runs; advantage = (blocking - NeverBlock) / blocking. " \
           "2009: Ruby 1.9.1, a pool of 50 fibers over 12 connections."
      puts Table.of(rows, %w[label longs queries blocking_s neverblock_s advantage_pct 2009_blocking_s 2009_non_blocking_s 2009_advantage_pct runs_s])
    end

    def report_short(rows)
      puts "\nAll short: #{@options[:queries]} `select $1` with an integer parameter (exec_params; pgbench: " \
           "`\\set x random(1, 1000)` + `select :x;`)."
      puts "Median of #{@options[:short_runs]} runs, every run listed (seconds); queries/s from the median. pgbench: its tps without connection time."
      puts Table.of(rows, %w[label median_s queries_per_s vs_blocking cpu_us_per_query cpu_vs_blocking allocations_per_query runs_s note])
      puts "cpu_us_per_query: user + system time of the Ruby client while it ran the queries, median; " \
           "the server's backends share the same #{Etc.nprocessors} CPUs."
      puts "CPUs kept awake: a busy-looping nice-19 process per CPU but one (Spinner, bench/support/harness.rb), " \
           "so that a client waiting for each reply does not pay for waking a halted virtual CPU twice per round trip."
    end

    def chart
      chart = NeverBlockBench.chart("NeverBlock and PostgreSQL", "#{Peers.text(@probe)}, #{PostgresServer.driver_description}",
                                    "long/short: a task per query, pool of #{@options[:pool_size]}; _awake: CPUs kept awake by a nice-19 busy loop")
      chart.pivot("long and short queries: time NeverBlock saved vs blocking, %, by long queries; a bar per shorts per long " \
                  "(higher is better)", "advantage_pct", by: "longs", series: "label", where: { "part" => "longshort" })
      chart.pivot("all short: queries/s (median; higher is better)", "queries_per_s", series: "variant", where: { "part" => "short" })
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::DbBench, "db") if $PROGRAM_NAME == __FILE__
