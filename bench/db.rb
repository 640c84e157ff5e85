#!/usr/bin/env ruby
# frozen_string_literal: true

# PostgreSQL through NeverBlock::Postgres, against a blocking client, threads and pgbench.
#
# 1. Long and short queries, 2009's "Faster IO for Ruby with Postgres": L
#    iterations (10, 50, 100) of one `select pg_sleep(0.05)` and M `select 1`
#    (M = 2 ... 100). Blocking: one PG::Connection, in order. NeverBlock: a task
#    per query, all at once, over NeverBlock::Postgres.pool(size: 12). The
#    advantage, (blocking - NeverBlock) / blocking, beside 2009's.
# 2. All short: --queries `select $1` (exec_params): blocking on one connection
#    (also with the CPUs kept awake, Spinner); 12 threads with a connection
#    each; 100 tasks over a pool of 12, and pipelined pools of 2, 4 and 12;
#    pg's pipeline mode by hand, no scheduler; pgbench (-M extended and
#    prepared, 1 and 12 clients, and pipelined). Ruby rows show the client's
#    CPU and allocations per query; the targets (issue 13) are printed.
#
#   bench/run db                Ruby 3.1 -> bench/results/db.{txt,csv,svg}, a throwaway server
#   bench/run --ruby 3.3 db     Ruby 3.3 -> bench/results/ruby33/
#   bench/run db --quick        smoke run: one round, 10 long queries, 500 short
#
# Every measurement is a forked child that connects and warms up before the
# clock starts; cells are measured --runs (part 1) or --short-runs (part 2)
# times, interleaved, and the median reported with every run beside it.
# pgbench comes from PATH or $PGBENCH (the Ruby 3.3 chroot has none: n/a).

require_relative "support/harness"
require_relative "support/postgres"

module NeverBlockBench
  # Runs the PostgreSQL benchmark and reports it. See the file comment.
  class DbBench
    include PostgresBench

    DEFAULTS = { longs: [10, 50, 100], ratios: [2, 5, 10, 20, 50, 100], long_seconds: 0.05, pool_size: 12, runs: 3,
                 queries: 10_000, fibers: 100, threads: 12, pipeline_sizes: [2, 4, 12], pgbench_clients: [1, 12],
                 pipeline_depth: 100, short_runs: 5, out: RESULTS, selector: Peers::DEFAULT_SELECTOR }.freeze
    QUICK = { longs: [10], ratios: [2, 10], runs: 1, queries: 500, short_runs: 1, pipeline_sizes: [2] }.freeze
    PARTS = %w[longshort short].freeze
    SHORT_SQL = "select 1"
    PARAM_SQL = "select $1"
    PGBENCH_SCRIPT = "\\set x random(1, 1000)\nselect :x;\n" # PARAM_SQL with a random integer
    OPEN_SQL = "select pg_sleep(0.02)" # long enough that each warm-up task holds a connection of its own
    WARM_UP = 500 # queries each measurement runs before its clock starts
    # 2009 (Ruby 1.9.1): [shorts per long, longs] => [blocking s, non-blocking s, advantage %].
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
    TARGET_POOL_CPU = 1.6 # client CPU per query at most this many times blocking's (issue 13)
    TARGET_PIPELINED_CPU = 1.1

    def initialize(options)
      @options = options
      @parts = CommandLine.parts(@options[:only], PARTS)
    end

    # @return [Boolean] true when every measurement succeeded
    def call
      return false unless ready_to_measure?

      @conninfo = PostgresServer.conninfo
      long_short = @parts.include?("longshort") ? measure_long_short : []
      short = @parts.include?("short") ? measure_short : []
      report(long_short, short)
      (long_short + short).none? { |cell| cell.failures.any? }
    end

    private

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

    # Runs the block in NeverBlock.run over a pool whose every connection was
    # opened and warmed up first: opening costs milliseconds of CPU on both
    # sides (SCRAM), which must not count.
    def with_pool(size, pipeline)
      require "neverblock/postgres"
      db = NeverBlock::Postgres.pool(size: size, pipeline: pipeline, **@conninfo)
      NeverBlock.run do
        NeverBlock.wait_all(Array.new([@options[:fibers], @options[:pool_size]].max) { NeverBlock.spawn { db.exec(OPEN_SQL) } })
        fan_out(db, WARM_UP)
        yield db
      end.tap { db.close }
    end

    # `count` exec_params over --fibers tasks, each running its share in order.
    def fan_out(db, count)
      NeverBlock.wait_all(NeverBlockBench.split(count, @options[:fibers]).map { |share| NeverBlock.spawn { share.times { |i| db.exec_params(PARAM_SQL, [i]) } } })
    end

    # --- part 2: all short ------------------------------------------------------

    # [name, label, chart label, kind (:ruby or :pgbench), measure (in the child: Hash with :seconds)]
    def short_variants
      fibers = @options[:fibers]
      variants = [["blocking", "blocking: one connection, in order", "blocking", :ruby, -> { blocking_short }],
                  ["blocking_awake", "blocking, CPUs kept awake (see below)", "blocking*", :ruby, -> { Spinner.awake { blocking_short } }],
                  ["threads", "#{@options[:threads]} threads, a connection each", "#{@options[:threads]} threads", :ruby, -> { threads_short }],
                  ["pool", "NeverBlock pool(size: #{@options[:pool_size]}), #{fibers} fibers", "pool #{@options[:pool_size]}", :ruby,
                   -> { with_pool(@options[:pool_size], false) { |db| NeverBlockBench.timed_with_cpu { fan_out(db, @options[:queries]) } } }]]
      variants += @options[:pipeline_sizes].map do |size|
        ["pipeline#{size}", "NeverBlock pool(size: #{size}, pipeline: true), #{fibers} fibers", "pipelined #{size}", :ruby,
         -> { with_pool(size, true) { |db| NeverBlockBench.timed_with_cpu { fan_out(db, @options[:queries]) } } }]
      end
      variants << ["raw_pipeline", "pg pipeline mode by hand, no scheduler (1 connection, #{@options[:pipeline_depth]} in flight)",
                   "pg pipeline", :ruby, -> { raw_pipeline_short }]
      %w[extended prepared].product(@options[:pgbench_clients]).each do |mode, clients|
        name = "pgbench_#{mode}_#{clients}"
        label = "pgbench -M #{mode}, #{clients} client#{'s' if clients > 1}"
        short = "#{mode == 'extended' ? 'ext.' : 'prep.'} #{clients}c"
        measure = -> { pgbench_short(PGBENCH_SCRIPT, 1, mode, clients) }
        variants << [name, label, short, :pgbench, measure]
        variants << ["#{name}_awake", "#{label}, CPUs kept awake", "#{short}*", :pgbench, -> { Spinner.awake(&measure) }] if clients == 1
      end
      depth = @options[:pipeline_depth]
      script = "\\set x random(1, 1000)\n\\startpipeline\n#{"select :x;\n" * depth}\\endpipeline\n"
      variants << ["pgbench_pipeline", "pgbench -M extended, 1 client, pipelined (#{depth} per \\startpipeline)", "pipelined 1c", :pgbench,
                   -> { pgbench_short(script, depth, "extended", 1) }]
    end

    def measure_short
      cells = short_variants.map do |name, label, short, kind, measure|
        Cell.new("#{@options[:queries]} short, #{name}", variant: name, label: label, short_label: short, kind: kind, measure: measure,
                                                         skipped: ("no pgbench here" if kind == :pgbench && !Pgbench.executable))
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
      result = Pgbench.run(script, mode: mode, clients: clients, transactions: transactions, env: PostgresServer.libpq_env)
      { seconds: @options[:queries] / (result.tps * per_transaction) }
    end

    # --- reporting -------------------------------------------------------------

    def rate(cell) = cell.median&.positive? ? @options[:queries] / cell.median : nil
    def cpu_us(cell) = cell.median_per(cell.cpu, @options[:queries] / 1e6)
    def allocations(cell) = cell.median_per(cell.allocations, @options[:queries])

    # @return [Float, nil] percent of blocking's time NeverBlock saved
    def advantage(cells, ratio, longs)
      slow, fast = %w[blocking neverblock].map { |v| cells.find { |c| c[:variant] == v && c[:ratio] == ratio && c[:longs] == longs }&.median }
      slow && fast ? (slow - fast) / slow * 100 : nil
    end

    def report(long_short, short)
      puts "\nload average at end: #{Machine.load_average}"
      report_long_short(long_short) unless long_short.empty?
      report_short(short) unless short.empty?
      failures = (long_short + short).flat_map(&:failures).uniq
      puts "\nfailed runs: #{failures.join('; ')}" unless failures.empty?
      rows = long_short.map do |cell|
        samples = cell.samples
        ours = advantage(long_short, cell[:ratio], cell[:longs]) if cell[:variant] == "neverblock"
        ["longshort", cell[:variant], nil, cell[:longs], cell[:longs] * cell[:ratio], cell[:longs] * (cell[:ratio] + 1), samples.to_s(digits: 4),
         samples.median&.round(4), samples.min&.round(4), samples.max&.round(4), nil, nil, nil, ours&.round(2),
         (RESULTS_2009[[cell[:ratio], cell[:longs]]]&.last if cell[:variant] == "neverblock"), cell.failures.first]
      end
      rows += short.map do |cell|
        samples = cell.samples
        ["short", cell[:variant], cell[:label], nil, @options[:queries], @options[:queries], samples.to_s(digits: 4), samples.median&.round(4),
         samples.min&.round(4), samples.max&.round(4), rate(cell)&.round(0), cpu_us(cell)&.round(2), allocations(cell)&.round(1), nil, nil,
         cell.skipped || cell.failures.first]
      end
      NeverBlockBench.write_results(@options[:out], "db", %w[part variant label longs shorts queries runs median_s min_s max_s queries_per_s
                                                              client_cpu_us_per_query allocations_per_query advantage_pct advantage_2009_pct note],
                                    rows, chart(long_short, short))
    end

    def report_long_short(cells)
      puts "\nLong and short queries: each of L iterations issues one `select pg_sleep(#{@options[:long_seconds]})` and M `select 1`."
      puts "Blocking: one PG::Connection, in order. NeverBlock: a task per query (NeverBlock.spawn), all at once, " \
           "NeverBlock::Postgres.pool(size: #{@options[:pool_size]})."
      puts "Seconds, median of #{@options[:runs]} runs; advantage = (blocking - NeverBlock) / blocking. " \
           "2009: Ruby 1.9.1, a pool of 50 fibers over 12 connections."
      table = Table.new(["shorts per long", "long", "short", "blocking s", "NeverBlock s", "advantage",
                         "2009 blocking s", "2009 non-blocking s", "2009 advantage", ">= 2009?"])
      @options[:ratios].product(@options[:longs]).each do |ratio, longs|
        seconds = %w[blocking neverblock].map do |v|
          cells.find { |c| c[:variant] == v && c[:ratio] == ratio && c[:longs] == longs }.median&.then { |s| format("%.3f", s) } || "failed"
        end
        ours = advantage(cells, ratio, longs)
        old_blocking, old_nonblocking, old = RESULTS_2009[[ratio, longs]]
        table << ["1/#{ratio}", longs, longs * ratio, *seconds, ours ? format("%.1f%%", ours) : "-", old_blocking, old_nonblocking,
                  old ? format("%.2f%%", old) : "-", ours && old ? (ours >= old ? "yes" : "NO") : "-"]
      end
      puts table
      spread = cells.select { |cell| cell.runs.size > 1 }.map { |cell| (cell.runs.max - cell.runs.min) / cell.runs.min * 100 }
      puts format("Runs of a cell differed by at most %.0f%% (median %.0f%%).", spread.max, Samples.new(spread).median) unless spread.empty?
    end

    def report_short(cells)
      puts "\nAll short: #{@options[:queries]} `select $1` with an integer parameter (exec_params; pgbench: " \
           "`\\set x random(1, 1000)` + `select :x;`)."
      puts "Median of #{@options[:short_runs]} runs, every run listed (seconds); queries/s from the median. pgbench: its tps without connection time."
      by = ->(name) { cells.find { |cell| cell[:variant] == name } }
      blocking = by.call("blocking")
      blocking_cpu = blocking && cpu_us(blocking)
      table = Table.new(["client", "median s", "queries/s", "vs blocking", "client CPU us/query", "CPU vs blocking", "allocations/query", "runs, s"])
      cells.each do |cell|
        next table << [cell[:label], "n/a", "", "", "", "", "", cell.skipped || cell.failures.first.to_s] if cell.runs.empty?

        cpu = cpu_us(cell)
        table << [cell[:label], format("%.3f", cell.median), format("%.0f", rate(cell)),
                  blocking && rate(blocking) ? format("%.2fx", rate(cell) / rate(blocking)) : "", cpu ? format("%.1f", cpu) : "",
                  cpu && blocking_cpu ? format("%.2fx", cpu / blocking_cpu) : "", allocations(cell)&.then { |a| format("%.1f", a) } || "",
                  cell.samples.to_s(digits: 3)]
      end
      puts table
      puts "client CPU: user + system time of the Ruby process while it ran the queries, median; " \
           "the server's backends share the same #{Etc.nprocessors} CPUs."
      puts "CPUs kept awake: with a busy-looping nice-19 process per CPU but one (Spinner in bench/support/harness.rb). " \
           "A client that waits for each reply pays, on an otherwise idle VM, for waking a halted virtual CPU " \
           "twice per round trip; this shows it without that."
      met = ->(ok) { ok ? "met" : "NOT met" }
      pipelined = cells.select { |cell| cell[:variant].start_with?("pipeline") && rate(cell) }
      if (best = pipelined.max_by { |cell| rate(cell) })
        puts "\nBest pipelined: #{best[:label]}, #{format('%.0f', rate(best))} queries/s " \
             "(#{pipelined.map { |cell| "size #{cell[:variant][/\d+/]}: #{format('%.0f', rate(cell))}" }.join(', ')})."
        [[blocking, "Target: pipelined >= %.0fx blocking: %.2fx, %s."], [by.call("blocking_awake"), "  against blocking with the CPUs kept awake: %.2fx, %s."]].each do |base, text|
          next unless base && rate(base)

          ratio = rate(best) / rate(base)
          puts format(text, *([TARGET_VS_BLOCKING] if text.start_with?("Target")), ratio, met.call(ratio >= TARGET_VS_BLOCKING))
        end
        pgbench = cells.select { |cell| cell[:kind] == :pgbench && cell[:variant] != "pgbench_pipeline" && rate(cell) }
        if (top = pgbench.max_by { |cell| rate(cell) })
          share = rate(best) / rate(top)
          puts format("Target: pipelined >= %.0f%% of pgbench's best (%s, %.0f queries/s): %.0f%%, %s.", TARGET_VS_PGBENCH * 100, top[:label],
                      rate(top), share * 100, met.call(share >= TARGET_VS_PGBENCH))
        else
          puts "Target: pipelined >= #{(TARGET_VS_PGBENCH * 100).round}% of pgbench's best: not measured here (no pgbench)."
        end
      end
      return puts("\nClient cost targets: not measured (no blocking run with CPU times).") unless blocking_cpu

      # Issue 13's targets on the client's cost, against the same run's blocking client.
      puts format("\nClient cost targets (CPU per query against blocking's %.1f us, same run):", blocking_cpu)
      cpu_target = lambda do |cell, limit|
        cpu = cpu_us(cell)
        next "Target: #{cell[:label]} CPU <= #{limit}x blocking: not measured." unless cpu

        format("Target: %s CPU <= %.1fx blocking: %.1f us/query, %.2fx (%.1f allocations/query), %s.", cell[:label], limit, cpu,
               cpu / blocking_cpu, allocations(cell) || Float::NAN, met.call(cpu <= limit * blocking_cpu))
      end
      pool, threads = by.call("pool"), by.call("threads") # rubocop:disable Style/ParallelAssignment
      puts cpu_target.call(pool, TARGET_POOL_CPU) if pool
      if pool && threads && rate(pool) && rate(threads)
        share = rate(pool) / rate(threads)
        puts format("Target: #{pool[:label]} >= #{threads[:label]} in queries/s: %.0f vs %.0f (%.2fx), %s.", rate(pool), rate(threads), share,
                    met.call(share >= 1))
      end
      cells.select { |cell| cell[:variant].start_with?("pipeline") }.each { |cell| puts cpu_target.call(cell, TARGET_PIPELINED_CPU) }
    end

    def chart(long_short, short)
      chart = SvgChart.new(title: "NeverBlock and PostgreSQL",
                           subtitle: ["ruby #{RUBY_VERSION}, #{versions_text}, #{PostgresServer.driver_description}",
                                      "#{Machine.description}; server on the same machine",
                                      "long/short: a task per query, pool of #{@options[:pool_size]}; * = CPUs kept awake by a nice-19 busy loop"])
      @options[:longs].each do |longs|
        next if long_short.empty?

        ours = @options[:ratios].map do |ratio|
          value = advantage(long_short, ratio, longs)
          value.nil? ? "failed" : value.negative? ? format("%.0f%%", value) : value # rubocop:disable Style/NestedTernaryOperator
        end
        chart.add_panel(title: "#{longs} long queries, time saved vs blocking, % (higher is better)", categories: @options[:ratios].map { |r| "1/#{r}" },
                        series: { "2009 advantage (Ruby 1.9.1)" => @options[:ratios].map { |ratio| RESULTS_2009[[ratio, longs]]&.last },
                                  "NeverBlock advantage" => ours })
      end
      return chart if short.empty?

      ruby, pgbench = short.partition { |cell| cell[:kind] == :ruby }
      [[ruby, "#{@options[:queries]} select $1 from Ruby, queries/s"], [pgbench, "pgbench (C) on the same query, queries/s"]].each do |cells, title|
        chart.add_panel(title: "#{title} (median; higher is better)", categories: cells.map { |cell| cell[:short_label] },
                        series: { "queries/s" => cells.map { |cell| rate(cell) || (cell.skipped ? "n/a" : "failed") } })
      end
      chart.add_panel(title: "Ruby client's CPU per query, us (median; lower is better)", categories: ruby.map { |cell| cell[:short_label] },
                      series: { "client CPU us/query" => ruby.map { |cell| cpu_us(cell) || "failed" } })
    end
  end
end

if $PROGRAM_NAME == __FILE__
  NeverBlockBench::CommandLine.main(NeverBlockBench::DbBench, "db", variants: "longshort,short (the parts)") do |opts, options|
    opts.on("--longs LIST", Array, "long queries per cell (10,50,100)") { |list| options[:longs] = NeverBlockBench::CommandLine.integers(list) }
    opts.on("--ratios LIST", Array, "short queries per long one (2,5,10,20,50,100)") { |list| options[:ratios] = NeverBlockBench::CommandLine.integers(list) }
    opts.on("--long-seconds SECONDS", Float, "pg_sleep of a long query (0.05)") { |value| options[:long_seconds] = value }
    opts.on("--pool-size N", Integer, "NeverBlock pool size for the unpipelined runs (12)") { |value| options[:pool_size] = value }
    opts.on("--runs N", Integer, "runs per long/short cell, median reported (3)") { |value| options[:runs] = value }
    opts.on("--queries N", Integer, "short queries per all-short run (10000)") { |value| options[:queries] = value }
    opts.on("--fibers N", Integer, "fibers issuing the short queries (100)") { |value| options[:fibers] = value }
    opts.on("--threads N", Integer, "threads (a connection each) in the all-short peer (12)") { |value| options[:threads] = value }
    opts.on("--pipeline-sizes LIST", Array, "pool sizes with pipeline: true (2,4,12)") { |list| options[:pipeline_sizes] = NeverBlockBench::CommandLine.integers(list) }
    opts.on("--pgbench-clients LIST", Array, "pgbench -c values (1,12)") { |list| options[:pgbench_clients] = NeverBlockBench::CommandLine.integers(list) }
    opts.on("--short-runs N", Integer, "runs per all-short client, median reported (5)") { |value| options[:short_runs] = value }
  end
end
