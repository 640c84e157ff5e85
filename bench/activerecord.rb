#!/usr/bin/env ruby
# frozen_string_literal: true

# ActiveRecord on NeverBlock, the 2009 "ActiveRecord meets NeverBlock"
# benchmarks rebuilt.
#
# 1. Workloads, --units (1000) of each, on a table of --rows (5000) rows:
#      Very Light  a count
#      Light       a count and a create
#      Moderate    2 counts and a create in a transaction that rolls back
#      Heavy       3 counts, a create and an update in a transaction that commits
#      Very Heavy  3 counts, a count on an unindexed column, a create and
#                  two updates in a transaction that commits
#    by the stock `postgresql` adapter, in order on one connection (also
#    with the CPUs kept awake, see bench/support/spinner.rb) and from
#    --threads (12) threads over a pool of as many connections, and by
#    `adapter: neverblock_postgresql` from --fibers (100) NeverBlock tasks
#    over a pool of --pool-size (12).
# 2. Connection scaling: NeverBlock with pools of 2, 4, 8, 16 and 32
#    connections running --sleeps (64) concurrent `select pg_sleep(0.1)`
#    (the time should halve as the connections double) and 5000 `select 1`
#    from 100 tasks (where more connections cannot help).
# 3. Ten concurrent `select pg_sleep(1)` through ActiveRecord: the stock
#    adapter in order (about 10 s), 10 threads, and NeverBlock in one
#    thread (about 1 s; 2009: 10.25 s against 1.08 s through Rails and Thin).
#
#   bench/run activerecord [options]              Ruby 3.1, ActiveRecord 7.2 (bench/results/)
#   bench/run --ruby 3.3 activerecord [options]   Ruby 3.3, ActiveRecord 8.1 (bench/results/ruby33/)
#   ... bench/activerecord.rb --only workloads --units 200 --runs 1
#
# bench/run starts PostgreSQL 15 with bin/databases; run directly, the
# script needs the NEVERBLOCK_PG_* variables (bench/support/postgres_server.rb).
# It creates, fills and finally drops the table neverblock_bench_users.
# Each measurement runs in a forked process that refills the table to
# --rows rows, connects and warms its connections up before the clock
# starts. Workload and scaling cells are measured --runs (3) times,
# interleaved, and the median is reported with every run beside it; the
# ten one-second sleeps once.
#
# Writes <out>/activerecord.csv and <out>/activerecord.svg (default out: bench/results).

require_relative "support/harness"
require_relative "support/postgres"

module NeverBlockBench
  # Runs the ActiveRecord benchmark and reports it. See the file comment.
  class ActiveRecordBench
    include PostgresBench

    DEFAULTS = {
      units: 1000,
      rows: 5000,
      pool_size: 12,
      fibers: 100,
      threads: 12,
      scaling_pools: [2, 4, 8, 16, 32],
      sleeps: 64,
      sleep_seconds: 0.1,
      selects: 5000,
      runs: 3,
      only: nil,
      out: File.expand_path("results", __dir__),
      selector: Peers::DEFAULT_SELECTOR
    }.freeze
    PARTS = %w[workloads scaling sleeps].freeze
    TABLE = "neverblock_bench_users"
    # Distinct group_id values (indexed) and score values (not indexed).
    GROUPS = 50
    SCORES = 1000

    # name => label, in the order of the 2009 post.
    WORKLOADS = {
      "very_light" => "Very Light: a count",
      "light" => "Light: count + create",
      "moderate" => "Moderate: 2 counts + create, rolled back",
      "heavy" => "Heavy: 3 counts + create + update, committed",
      "very_heavy" => "Very Heavy: 3 counts + unindexed count + create + 2 updates, committed"
    }.freeze

    # The clients of the ten one-second sleeps, by variant name.
    SLEEP_LABELS = {
      "blocking" => "postgresql adapter, in order, 1 connection",
      "threads" => "postgresql adapter, 10 threads, pool 10",
      "neverblock" => "neverblock_postgresql, 10 tasks, pool 10"
    }.freeze

    # How the workloads are driven: `adapter` is the database.yml name,
    # `series` names it in the chart (the same in every panel), `awake`
    # runs it with the CPUs kept awake (workloads only).
    Variant = Struct.new(:name, :label, :adapter, :series, :awake, keyword_init: true)

    def initialize(options)
      @options = DEFAULTS.merge(options)
      @parts = @options[:only] || PARTS
      unknown = @parts - PARTS
      raise OptionParser::InvalidArgument, "unknown part(s) #{unknown.join(', ')}; use #{PARTS.join(',')}" unless unknown.empty?

      @variants = [
        Variant.new(name: "blocking", label: "postgresql adapter, in order, 1 connection", adapter: "postgresql",
                    series: "postgresql adapter, in order"),
        Variant.new(name: "blocking_awake", label: "the same, CPUs kept awake", adapter: "postgresql",
                    series: "postgresql adapter, in order, CPUs kept awake", awake: true),
        Variant.new(name: "threads", adapter: "postgresql", series: "postgresql adapter, threads",
                    label: "postgresql adapter, #{@options[:threads]} threads, pool #{@options[:threads]}"),
        Variant.new(name: "neverblock", adapter: "neverblock_postgresql", series: "neverblock_postgresql, NeverBlock tasks",
                    label: "neverblock_postgresql, #{@options[:fibers]} tasks, pool #{@options[:pool_size]}")
      ]
    end

    # Runs the parts asked for, prints the tables, writes CSV and SVG.
    #
    # @return [Boolean] true when every measurement succeeded
    def call
      return false unless ready_to_measure?

      create_table
      begin
        rows = []
        rows += measure_workloads if @parts.include?("workloads")
        rows += measure_scaling if @parts.include?("scaling")
        rows += measure_sleeps if @parts.include?("sleeps")
      ensure
        drop_table
      end
      report(rows)
      rows.none? { |row| row[:failures].any? }
    end

    private

    def header
      <<~TEXT
        NeverBlock ActiveRecord benchmark: the 2009 workloads, connection scaling, ten one-second queries
        #{Machine.ruby_description}
        activerecord #{Machine.gem_version('activerecord')}, #{versions_text}, io-event selector #{@probe.is_a?(Isolated::Failure) ? 'unknown' : @probe.neverblock_selector}
        #{PostgresServer.driver_description}; server: #{PostgresServer.description}
        #{Machine.description}; server and client on the same machine
        Each measurement runs in a forked process that refills #{TABLE} to #{@options[:rows]} rows, connects and warms up before timing.
        load average at start: #{Machine.load_average}
      TEXT
    end

    # --- the table ----------------------------------------------------------------

    # In the parent, with plain pg: the children only refill it.
    def create_table
      with_pg do |conn|
        conn.exec("DROP TABLE IF EXISTS #{TABLE}")
        conn.exec(<<~SQL)
          CREATE TABLE #{TABLE} (
            id bigserial PRIMARY KEY,
            name varchar NOT NULL,
            group_id integer NOT NULL,
            score integer NOT NULL,
            visits integer NOT NULL DEFAULT 0,
            created_at timestamp(6) NOT NULL,
            updated_at timestamp(6) NOT NULL
          )
        SQL
        conn.exec("CREATE INDEX #{TABLE}_group_id ON #{TABLE} (group_id)")
      end
    end

    def drop_table
      with_pg { |conn| conn.exec("DROP TABLE IF EXISTS #{TABLE}") }
    rescue StandardError => e
      warn "could not drop #{TABLE}: #{e.message}"
    end

    # Back to --rows rows (ids 1..rows), analysed, before a measurement.
    def refill_table
      with_pg do |conn|
        conn.exec("TRUNCATE #{TABLE} RESTART IDENTITY")
        conn.exec_params(<<~SQL, [@options[:rows], GROUPS, SCORES])
          INSERT INTO #{TABLE} (name, group_id, score, created_at, updated_at)
          SELECT 'user ' || i, i % $2::int, (i * 7919) % $3::int, now(), now() FROM generate_series(1, $1::int) AS i
        SQL
        conn.exec("ANALYZE #{TABLE}")
      end
    end

    def with_pg
      require "pg"
      conn = PG.connect(**PostgresServer.conninfo)
      yield conn
    ensure
      conn&.close
    end

    # --- in a child: ActiveRecord ------------------------------------------------

    # Loads ActiveRecord (and NeverBlock's adapter for `neverblock_postgresql`),
    # connects and defines the model. @return [Class] the model
    def connect(adapter, pool)
      if adapter == "neverblock_postgresql"
        require "neverblock/active_record"
      else
        require "active_record"
      end
      ActiveRecord::Base.logger = nil
      # A generous checkout_timeout: the scaling part queues 64 one-tenth-second queries on 2 connections.
      ActiveRecord::Base.establish_connection(PostgresServer.active_record_config(adapter: adapter, pool: pool)
                                                            .merge(checkout_timeout: 30))
      model = Class.new(ActiveRecord::Base) { self.table_name = TABLE }
      Object.const_set(:NeverBlockBenchUser, model) unless Object.const_defined?(:NeverBlockBenchUser)
      NeverBlockBenchUser
    end

    # One unit of a workload (the 2009 definitions); `random` picks the
    # rows it touches.
    def unit(model, workload, random)
      model.connection_pool.with_connection do
        case workload
        when "very_light" then model.count
        when "light"
          model.count
          create(model, random)
        when "moderate"
          model.transaction do
            model.count
            model.where(group_id: random.rand(GROUPS)).count
            create(model, random)
            raise ActiveRecord::Rollback
          end
        when "heavy"
          model.transaction do
            three_counts(model, random)
            create(model, random)
            bump(model, random)
          end
        when "very_heavy"
          model.transaction do
            three_counts(model, random)
            model.where(score: random.rand(SCORES)).count # no index on score: a sequential scan
            create(model, random).update!(visits: 1)
            bump(model, random)
          end
        end
      end
    end

    def three_counts(model, random)
      model.count
      model.where(group_id: random.rand(GROUPS)).count
      model.where("id > ?", random.rand(@options[:rows])).count
    end

    def create(model, random)
      model.create!(name: "new #{random.rand(1_000_000)}", group_id: random.rand(GROUPS), score: random.rand(SCORES))
    end

    # One UPDATE of an existing row. A transaction locks at most this row
    # and the one it created, so concurrent ones cannot deadlock.
    def bump(model, random)
      model.where(id: random.rand(1..@options[:rows])).update_all("visits = visits + 1")
    end

    # @return [Float] seconds for `units` units from `workers` threads or
    #   tasks (or in order when nil)
    def run_units(model, workload, units, variant, first: 0)
      shares = split(units, sequential?(variant) ? 1 : workers(variant))
      offsets = shares.each_with_index.map { |_, i| first + shares.take(i).sum }
      job = ->(offset, share) { share.times { |i| unit(model, workload, Random.new(offset + i)) } }
      if sequential?(variant)
        timed { job.call(first, units) }
      elsif variant.name == "threads"
        timed { offsets.zip(shares).map { |o, s| Thread.new { job.call(o, s) } }.each(&:join) }
      else
        NeverBlock.run { timed { NeverBlock.wait_all(offsets.zip(shares).map { |o, s| NeverBlock.spawn { job.call(o, s) } }) } }
      end
    end

    def sequential?(variant)
      variant.name.start_with?("blocking")
    end

    def sleep_pool(variant)
      sequential?(variant) ? 1 : 10
    end

    def workers(variant)
      variant.name == "threads" ? @options[:threads] : @options[:fibers]
    end

    def pool_for(variant)
      return 1 if sequential?(variant)

      variant.name == "threads" ? @options[:threads] : @options[:pool_size]
    end

    # --- part 1: workloads -----------------------------------------------------------

    def measure_workloads
      rows = WORKLOADS.keys.product(@variants).map do |workload, variant|
        { part: "workloads", workload: workload, variant: variant, runs: [], failures: [] }
      end
      measure_rows(rows) do |row|
        variant = row[:variant]
        refill_table
        model = connect(variant.adapter, pool_for(variant))
        # Warm-up: every connection opened, the statements prepared.
        open_connections(model, variant.name == "neverblock" ? :tasks : :threads, pool_for(variant))
        warm = [workers(variant), 100].max
        run_units(model, row[:workload], warm, variant, first: 1_000_000)
        measure = -> { run_units(model, row[:workload], @options[:units], variant) }
        variant.awake ? Spinner.awake(&measure) : measure.call
      end
    end

    # --- part 2: connection scaling -------------------------------------------------

    def measure_scaling
      rows = @options[:scaling_pools].flat_map do |pool|
        %w[sleep select].map { |kind| { part: "scaling", kind: kind, pool: pool, runs: [], failures: [] } }
      end
      measure_rows(rows) do |row|
        model = connect("neverblock_postgresql", row[:pool])
        open_connections(model, :tasks, row[:pool])
        NeverBlock.run do
          concurrent(model, 100, 200, "select 1")
          if row[:kind] == "sleep"
            timed { concurrent(model, @options[:sleeps], @options[:sleeps], format("select pg_sleep(%.3f)", @options[:sleep_seconds])) }
          else
            timed { concurrent(model, 100, @options[:selects], "select 1") }
          end
        end
      end
    end

    # Opens all `pool` connections of the model's pool before the clock
    # starts: connecting costs milliseconds of CPU on both sides (SCRAM
    # authentication), and fast queries alone would open only some of them.
    # `pool` threads or tasks each take a connection, use it, and hold it
    # until all have one: libpq computes SCRAM's key on the calling thread,
    # so concurrent connects in one event loop finish one after another,
    # and a fixed short hold lets the first ones go before the last open.
    def open_connections(model, how, pool)
      lock = Thread::Mutex.new
      ready = 0
      hold = lambda do
        model.connection_pool.with_connection do |conn|
          query(conn, "select 1")
          lock.synchronize { ready += 1 }
          deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 30
          sleep(0.005) until lock.synchronize { ready } >= pool || Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
        end
      end
      if how == :tasks
        NeverBlock.run { NeverBlock.wait_all(Array.new(pool) { NeverBlock.spawn(&hold) }) }
      else
        Array.new(pool) { Thread.new(&hold) }.each(&:join)
      end
      opened = model.connection_pool.connections.size
      raise "opened #{opened} of #{pool} connections before timing" if opened < pool
    end

    # `count` queries from `tasks` NeverBlock tasks, each with a connection
    # per query.
    def concurrent(model, tasks, count, sql)
      NeverBlock.wait_all(split(count, tasks).map do |share|
        NeverBlock.spawn { share.times { model.connection_pool.with_connection { |conn| query(conn, sql) } } }
      end)
    end

    # `execute` rather than `select_value` for pg_sleep, whose void result
    # ActiveRecord would warn about (unknown OID 2278).
    def query(conn, sql)
      sql.include?("pg_sleep") ? conn.execute(sql).clear : conn.select_value(sql)
    end

    # --- part 3: ten one-second sleeps ----------------------------------------------

    def measure_sleeps
      rows = @variants.reject(&:awake).map { |variant| { part: "sleeps", variant: variant, runs: [], failures: [] } }
      measure_rows(rows, runs: 1) do |row|
        variant = row[:variant]
        model = connect(variant.adapter, sleep_pool(variant))
        open_connections(model, variant.name == "neverblock" ? :tasks : :threads, sleep_pool(variant))
        sleep_one = -> { model.connection_pool.with_connection { |conn| query(conn, "select pg_sleep(1)") } }
        case variant.name
        when "blocking" then timed { 10.times { sleep_one.call } }
        when "threads" then timed { Array.new(10) { Thread.new { sleep_one.call } }.each(&:join) }
        else NeverBlock.run { timed { NeverBlock.wait_all(Array.new(10) { NeverBlock.spawn { sleep_one.call } }) } }
        end
      end
    end

    # --- measuring -------------------------------------------------------------------

    # Measures every row `runs` times, interleaved, each run in a forked
    # child running the block.
    def measure_rows(rows, runs: @options[:runs])
      runs.times do |run|
        rows.each do |row|
          outcome = Isolated.run(timeout: 300) { yield row }
          outcome.is_a?(Isolated::Failure) ? row[:failures] << outcome.to_s : row[:runs] << outcome
          text = outcome.is_a?(Isolated::Failure) ? "FAILED #{outcome}" : format("%.3f s", outcome)
          warn "  #{row_name(row)}, run #{run + 1}: #{text}"
        end
      end
      rows
    end

    def row_name(row)
      case row[:part]
      when "workloads" then "#{row[:workload]} x #{@options[:units]}, #{row[:variant].name}"
      when "scaling" then "pool #{row[:pool]}, #{row[:kind]}"
      else "10 x pg_sleep(1), #{row[:variant].name}"
      end
    end

    # @return [Array<Integer>] `total` split into `parts` shares that differ by at most 1
    def split(total, parts)
      Array.new(parts) { |i| (total / parts) + (i < total % parts ? 1 : 0) }.reject(&:zero?)
    end

    def timed
      started = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      yield
      Process.clock_gettime(Process::CLOCK_MONOTONIC) - started
    end

    def median(row)
      row && Samples.new(row[:runs]).median
    end

    def seconds_text(row)
      value = median(row)
      value ? format("%.3f", value) : "failed"
    end

    # --- reporting -------------------------------------------------------------------

    def report(rows)
      puts "\nload average at end: #{Machine.load_average}"
      workloads = rows.select { |row| row[:part] == "workloads" }
      scaling = rows.select { |row| row[:part] == "scaling" }
      sleeps = rows.select { |row| row[:part] == "sleeps" }
      report_workloads(workloads) unless workloads.empty?
      report_scaling(scaling) unless scaling.empty?
      report_sleeps(sleeps) unless sleeps.empty?
      failures = rows.flat_map { |row| row[:failures] }.uniq
      puts "\nfailed runs: #{failures.join('; ')}" unless failures.empty?
      FileUtils.mkdir_p(@options[:out])
      csv = write_csv(rows)
      svg = write_svg(workloads, scaling, sleeps)
      puts "\nwrote #{CommandLine.relative(csv)} and #{CommandLine.relative(svg)}"
    end

    def report_workloads(rows)
      puts "\nWorkloads: #{@options[:units]} units each on #{@options[:rows]} rows; seconds, median of #{@options[:runs]} runs."
      puts @variants.map { |variant| "#{variant.name}: #{variant.label}" }.join("; ")
      table = Table.new(["workload"] + @variants.map { |variant| "#{variant.name} s" } +
                        ["units/s NeverBlock", "NeverBlock vs blocking", "vs blocking_awake", "vs threads"])
      WORKLOADS.each do |workload, label|
        found = @variants.to_h { |variant| [variant.name, find(rows, workload: workload, variant: variant)] }
        nb = median(found["neverblock"])
        table << [label] + @variants.map { |variant| seconds_text(found[variant.name]) } +
                 [nb ? format("%.0f", @options[:units] / nb) : "-", speedup(found["blocking"], found["neverblock"]),
                  speedup(found["blocking_awake"], found["neverblock"]), speedup(found["threads"], found["neverblock"])]
      end
      puts table
      puts "runs (s): " + rows.map { |row| "#{row[:workload]}/#{row[:variant].name} #{Samples.new(row[:runs])}" }.join("; ")
    end

    def report_scaling(rows)
      puts "\nConnection scaling, neverblock_postgresql: #{@options[:sleeps]} concurrent " \
           "`select pg_sleep(#{@options[:sleep_seconds]})`, and #{@options[:selects]} `select 1` from 100 tasks; " \
           "seconds, median of #{@options[:runs]} runs."
      table = Table.new(["pool", "#{@options[:sleeps]} x pg_sleep s", "ideal s", "vs half the pool",
                         "#{@options[:selects]} x select 1 s", "select 1/s", "runs (sleep; select)"])
      previous = nil
      @options[:scaling_pools].each do |pool|
        sleep_row = find(rows, kind: "sleep", pool: pool)
        select_row = find(rows, kind: "select", pool: pool)
        ideal = (@options[:sleeps].to_f / pool).ceil * @options[:sleep_seconds]
        slept = median(sleep_row)
        table << [pool, seconds_text(sleep_row), format("%.2f", ideal),
                  previous && slept ? format("%.2fx faster", previous / slept) : "",
                  seconds_text(select_row), median(select_row) ? format("%.0f", @options[:selects] / median(select_row)) : "-",
                  "#{Samples.new(sleep_row[:runs])}; #{Samples.new(select_row[:runs])}"]
        previous = slept
      end
      puts table
    end

    def report_sleeps(rows)
      puts "\nTen concurrent `select pg_sleep(1)` through ActiveRecord (one run each). " \
           "2009, through Rails and Thin: 10.25 s postgresql, 1.08 s neverblock_postgresql (9.5x)."
      blocking = find(rows, variant_name: "blocking")
      table = Table.new(["client", "seconds", "vs blocking"])
      rows.each do |row|
        table << [SLEEP_LABELS[row[:variant].name], seconds_text(row), speedup(blocking, row)]
      end
      puts table
    end

    def speedup(slow, fast)
      a = median(slow)
      b = median(fast)
      a && b ? format("%.2fx", a / b) : "-"
    end

    def find(rows, workload: nil, variant: nil, variant_name: nil, kind: nil, pool: nil)
      rows.find do |row|
        (workload.nil? || row[:workload] == workload) && (variant.nil? || row[:variant].equal?(variant)) &&
          (variant_name.nil? || row[:variant].name == variant_name) && (kind.nil? || row[:kind] == kind) &&
          (pool.nil? || row[:pool] == pool)
      end
    end

    def write_csv(rows)
      headers = %w[part variant label workload pool queries runs median_s min_s max_s per_s note]
      lines = rows.map do |row|
        samples = Samples.new(row[:runs])
        count = case row[:part]
                when "workloads" then @options[:units]
                when "scaling" then row[:kind] == "sleep" ? @options[:sleeps] : @options[:selects]
                else 10
                end
        variant = row[:variant]
        label = if row[:part] == "sleeps" then SLEEP_LABELS[variant.name]
                elsif variant then variant.label
                else "#{row[:kind]}, pool #{row[:pool]}"
                end
        [row[:part], variant ? variant.name : "neverblock", label,
         row[:workload] || row[:kind], row[:pool] || (row[:part] == "sleeps" ? sleep_pool(variant) : pool_for(variant)),
         count, samples.to_s(digits: 4), samples.median&.round(4), samples.min&.round(4), samples.max&.round(4),
         samples.median ? (count / samples.median).round(1) : nil, row[:failures].first]
      end
      CsvFile.write(File.join(@options[:out], "activerecord.csv"), headers, lines)
    end

    def write_svg(workloads, scaling, sleeps)
      chart = SvgChart.new(title: "ActiveRecord #{Machine.gem_version('activerecord')} on NeverBlock",
                           subtitle: ["ruby #{RUBY_VERSION}, #{versions_text}, #{PostgresServer.driver_description}",
                                      "#{Machine.description}; server on the same machine",
                                      "workloads: #{@options[:threads]} threads or #{@options[:fibers]} tasks over " \
                                      "#{@options[:pool_size]} connections; ten sleeps: 10 threads or 10 tasks, pool 10"])
      unless workloads.empty?
        chart.add_panel(title: "#{@options[:units]} of each workload, seconds (lower is better)",
                        categories: WORKLOADS.values.map { |label| label.split(":").first },
                        series: @variants.to_h do |variant|
                          [variant.series, WORKLOADS.keys.map { |w| median(find(workloads, workload: w, variant: variant)) || "failed" }]
                        end)
      end
      unless scaling.empty?
        categories = @options[:scaling_pools].map { |pool| "pool #{pool}" }
        chart.add_panel(title: "#{@options[:sleeps]} concurrent pg_sleep(#{@options[:sleep_seconds]}), seconds by pool size (lower is better)",
                        categories: categories,
                        series: { @variants.last.series => @options[:scaling_pools].map { |pool| median(find(scaling, kind: "sleep", pool: pool)) || "failed" },
                                  "ideal: ceil(#{@options[:sleeps]} / pool) x #{@options[:sleep_seconds]} s" =>
                                    @options[:scaling_pools].map { |pool| (@options[:sleeps].to_f / pool).ceil * @options[:sleep_seconds] } })
        chart.add_panel(title: "#{@options[:selects]} x select 1, seconds by pool size (lower is better)", categories: categories,
                        series: { @variants.last.series => @options[:scaling_pools].map { |pool| median(find(scaling, kind: "select", pool: pool)) || "failed" } })
      end
      unless sleeps.empty?
        chart.add_panel(title: "10 concurrent pg_sleep(1), seconds (lower is better)",
                        categories: ["10 x pg_sleep(1)"],
                        series: sleeps.to_h { |row| [row[:variant].series, [median(row) || "failed"]] })
      end
      chart.write(File.join(@options[:out], "activerecord.svg"))
    end
  end
end

if $PROGRAM_NAME == __FILE__
  options = {}
  integers = ->(list) { list.map { |value| Integer(value.delete("_")) } }
  parser = OptionParser.new do |opts|
    opts.banner = "Usage: ruby bench/activerecord.rb [options]"
    opts.on("--units N", Integer, "units of each workload (1000)") { |value| options[:units] = value }
    opts.on("--rows N", Integer, "rows in the table at the start of each measurement (5000)") { |value| options[:rows] = value }
    opts.on("--pool-size N", Integer, "NeverBlock's pool for the workloads (12)") { |value| options[:pool_size] = value }
    opts.on("--fibers N", Integer, "NeverBlock tasks running the workloads (100)") { |value| options[:fibers] = value }
    opts.on("--threads N", Integer, "threads (and pool size) of the threaded stock runs (12)") { |value| options[:threads] = value }
    opts.on("--scaling-pools LIST", Array, "pool sizes for the scaling part (2,4,8,16,32)") do |list|
      options[:scaling_pools] = integers.call(list)
    end
    opts.on("--sleeps N", Integer, "concurrent pg_sleep queries in the scaling part (64)") { |value| options[:sleeps] = value }
    opts.on("--selects N", Integer, "select 1 queries in the scaling part (5000)") { |value| options[:selects] = value }
    opts.on("--runs N", Integer, "runs per workload and scaling cell, median reported (3)") { |value| options[:runs] = value }
    NeverBlockBench::CommandLine.shared_options(opts, options, results: "activerecord",
                                                               variants: "workloads,scaling,sleeps (the parts)")
  end
  NeverBlockBench::CommandLine.run(parser) { NeverBlockBench::ActiveRecordBench.new(options).call }
end
