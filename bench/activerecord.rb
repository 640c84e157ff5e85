#!/usr/bin/env ruby
# frozen_string_literal: true

# 2009's "ActiveRecord meets NeverBlock": (1) five workloads, --units each on
# --rows rows (from a count to 3 counts + an unindexed one + create + 2
# updates), by the stock postgresql adapter in order (also with the CPUs kept
# awake) and from --threads threads, and by neverblock_postgresql from
# --fibers tasks over --pool-size connections; (2) connection scaling: pools
# of --scaling-pools running --sleeps concurrent pg_sleep(0.1) and --selects
# `select 1`; (3) ten concurrent pg_sleep(1). Each measurement is a forked
# child that refills neverblock_bench_users (dropped at the end), connects and
# warms up first; --runs interleaved rounds (the sleeps once), medians.
#
#   bench/run activerecord              Ruby 3.1, ActiveRecord 7.2 -> bench/results/activerecord.{txt,csv,svg}
#   bench/run --ruby 3.3 activerecord   Ruby 3.3, ActiveRecord 8.1 -> bench/results/ruby33/
#   bench/run activerecord --quick      smoke run: 50 units, pools 2 and 8, ten 0.1 s sleeps, one round

require_relative "support/harness"
require_relative "support/postgres"

module NeverBlockBench
  class ActiveRecordBench < Bench
    DEFAULTS = { units: 1000, rows: 5000, pool_size: 12, fibers: 100, threads: 12, scaling_pools: [2, 4, 8, 16, 32], sleeps: 64,
                 sleep_seconds: 0.1, selects: 5000, ten_sleeps: 1.0, runs: 3 }.freeze
    QUICK = { units: 50, rows: 500, scaling_pools: [2, 8], sleeps: 8, selects: 200, ten_sleeps: 0.1, runs: 1 }.freeze
    ONLY = %w[workloads scaling sleeps].freeze # the parts
    TABLE = "neverblock_bench_users"
    GROUPS = 50 # distinct group_id values (indexed)
    SCORES = 1000 # distinct score values (not indexed)
    WORKLOADS = { "very_light" => "Very Light: a count", "light" => "Light: count + create",
                  "moderate" => "Moderate: 2 counts + create, rolled back", "heavy" => "Heavy: 3 counts + create + update, committed",
                  "very_heavy" => "Very Heavy: 3 counts + unindexed count + create + 2 updates, committed" }.freeze
    SLEEP_LABELS = { "blocking" => "postgresql adapter, in order, 1 connection", "threads" => "postgresql adapter, 10 threads, pool 10",
                     "neverblock" => "neverblock_postgresql, 10 tasks, pool 10" }.freeze
    Variant = Struct.new(:name, :label) do
      def sequential? = name.start_with?("blocking")
      def awake = name == "blocking_awake" # CPUs kept awake
      def adapter = name == "neverblock" ? "neverblock_postgresql" : "postgresql" # the database.yml name
    end

    def initialize(options)
      super
      @variants = { "blocking" => SLEEP_LABELS["blocking"], "blocking_awake" => "the same, CPUs kept awake",
                    "threads" => "postgresql adapter, #{@options[:threads]} threads, pool #{@options[:threads]}",
                    "neverblock" => "neverblock_postgresql, #{@options[:fibers]} tasks, pool #{@options[:pool_size]}" }
                  .map { |name, label| Variant.new(name, label) }
    end

    # @return [Boolean] true when every measurement succeeded
    def call
      return warn(PostgresServer.problem) if PostgresServer.problem

      @probe = Peers.start { |probe| header(probe) } or return false
      PostgresServer.connect do |conn|
        conn.exec("DROP TABLE IF EXISTS #{TABLE}")
        conn.exec("CREATE TABLE #{TABLE} (id bigserial PRIMARY KEY, name varchar NOT NULL, group_id integer NOT NULL, " \
                  "score integer NOT NULL, visits integer NOT NULL DEFAULT 0, created_at timestamp(6) NOT NULL, updated_at timestamp(6) NOT NULL)")
        conn.exec("CREATE INDEX #{TABLE}_group_id ON #{TABLE} (group_id)")
      end
      cells = @options[:only].flat_map { |part| send("measure_#{part}") }
      report(cells)
      cells.none? { |cell| cell.failures.any? }
    ensure
      PostgresServer.connect { |conn| conn.exec("DROP TABLE IF EXISTS #{TABLE}") } unless PostgresServer.problem
    end

    private

    def header(probe)
      NeverBlockBench.header(
        "NeverBlock ActiveRecord benchmark: the 2009 workloads, connection scaling, ten one-second queries",
        "activerecord #{Machine.gem_version('activerecord')}, #{Peers.text(probe)}",
        "#{PostgresServer.driver_description}; server: #{PostgresServer.description}, on the same machine",
        "Each measurement runs in a forked process that refills #{TABLE} to #{@options[:rows]} rows, connects and warms up before timing."
      )
    end

    # Back to --rows rows (ids 1..rows), analysed: in the child, before it measures.
    def refill_table
      PostgresServer.connect do |conn|
        conn.exec("TRUNCATE #{TABLE} RESTART IDENTITY")
        conn.exec_params("INSERT INTO #{TABLE} (name, group_id, score, created_at, updated_at) SELECT 'user ' || i, i % $2::int, " \
                         "(i * 7919) % $3::int, now(), now() FROM generate_series(1, $1::int) AS i", [@options[:rows], GROUPS, SCORES])
        conn.exec("ANALYZE #{TABLE}")
      end
    end

    # Loads ActiveRecord (NeverBlock's adapter for neverblock_postgresql), connects.
    # @return [Class] the model
    def connect(adapter, pool)
      require adapter == "neverblock_postgresql" ? "neverblock/active_record" : "active_record"
      ActiveRecord::Base.logger = nil
      info = PostgresServer.conninfo
      # A generous checkout_timeout: the scaling part queues 64 one-tenth-second queries on 2 connections.
      ActiveRecord::Base.establish_connection(adapter: adapter, host: info[:host], port: Integer(info[:port]), username: info[:user],
                                              password: info[:password], database: info[:dbname], pool: pool, checkout_timeout: 30)
      Object.const_set(:NeverBlockBenchUser, Class.new(ActiveRecord::Base) { self.table_name = TABLE }) unless Object.const_defined?(:NeverBlockBenchUser)
      NeverBlockBenchUser
    end

    # One unit of a workload (2009's definitions); `random` picks the rows. A
    # transaction locks at most the row it updates and the one it created: no deadlocks.
    def unit(model, workload, random)
      create = -> { model.create!(name: "new #{random.rand(1_000_000)}", group_id: random.rand(GROUPS), score: random.rand(SCORES)) }
      bump = -> { model.where(id: random.rand(1..@options[:rows])).update_all("visits = visits + 1") }
      counts = lambda do |n|
        model.count
        model.where(group_id: random.rand(GROUPS)).count if n > 1
        model.where("id > ?", random.rand(@options[:rows])).count if n > 2
      end
      model.connection_pool.with_connection do
        case workload
        when "very_light" then model.count
        when "light" then counts.call(1) && create.call
        when "moderate" then model.transaction { counts.call(2) && create.call && raise(ActiveRecord::Rollback) }
        when "heavy" then model.transaction { counts.call(3) && create.call && bump.call }
        when "very_heavy"
          model.transaction do
            counts.call(3)
            model.where(score: random.rand(SCORES)).count # no index on score: a sequential scan
            create.call.update!(visits: 1)
            bump.call
          end
        end
      end
    end

    def workers(variant) = variant.name == "threads" ? @options[:threads] : @options[:fibers]
    def pool_for(variant) = variant.sequential? ? 1 : (variant.name == "threads" ? @options[:threads] : @options[:pool_size])

    # @return [Float] seconds for `units` units, in order, from threads or from tasks
    def run_units(model, workload, units, variant, first: 0)
      shares = NeverBlockBench.split(units, variant.sequential? ? 1 : workers(variant))
      jobs = shares.each_with_index.map do |share, i|
        offset = first + shares.take(i).sum
        -> { share.times { |j| unit(model, workload, Random.new(offset + j)) } }
      end
      timed_jobs(variant, jobs)
    end

    # @return [Float] seconds the callables took: in order, a thread each, or a NeverBlock task each, as `variant` runs
    def timed_jobs(variant, jobs)
      if variant.sequential? then NeverBlockBench.timed { jobs.each(&:call) }
      elsif variant.name == "threads" then NeverBlockBench.timed { jobs.map { |job| Thread.new(&job) }.each(&:join) }
      else NeverBlock.run { NeverBlockBench.timed { NeverBlock.wait_all(jobs.map { |job| NeverBlock.spawn(&job) }) } }
      end
    end

    def measure_workloads
      cells = WORKLOADS.keys.product(@variants).map do |workload, variant|
        Cell.new("#{workload} x #{@options[:units]}, #{variant.name}", part: "workloads", workload: workload, variant: variant,
                                                                        label: variant.label, pool: pool_for(variant), queries: @options[:units])
      end
      NeverBlockBench.rounds(cells, @options[:runs], timeout: 300) do |cell|
        variant = cell[:variant]
        refill_table
        model = connect(variant.adapter, pool_for(variant))
        open_connections(model, variant.name == "neverblock", pool_for(variant))
        run_units(model, cell[:workload], [workers(variant), 100].max, variant, first: 1_000_000) # warm-up: statements prepared
        measure = -> { run_units(model, cell[:workload], @options[:units], variant) }
        variant.awake ? Spinner.awake(&measure) : measure.call
      end
    end

    def measure_scaling
      cells = @options[:scaling_pools].product(%w[sleep select]).map do |pool, kind|
        Cell.new("pool #{pool}, #{kind}", part: "scaling", workload: kind, pool: pool, label: "#{kind}, pool #{pool}",
                                          queries: kind == "sleep" ? @options[:sleeps] : @options[:selects])
      end
      NeverBlockBench.rounds(cells, @options[:runs], timeout: 300) do |cell|
        model = connect("neverblock_postgresql", cell[:pool])
        open_connections(model, true, cell[:pool])
        NeverBlock.run do
          concurrent(model, 100, 200, "select 1")
          sleep_sql = format("select pg_sleep(%.3f)", @options[:sleep_seconds])
          NeverBlockBench.timed do
            cell[:workload] == "sleep" ? concurrent(model, @options[:sleeps], @options[:sleeps], sleep_sql) : concurrent(model, 100, @options[:selects], "select 1")
          end
        end
      end
    end

    def measure_sleeps
      cells = @variants.reject(&:awake).map do |variant|
        Cell.new("10 x pg_sleep(#{@options[:ten_sleeps]}), #{variant.name}", part: "sleeps", variant: variant, label: SLEEP_LABELS[variant.name],
                                                                               pool: variant.sequential? ? 1 : 10, queries: 10)
      end
      NeverBlockBench.rounds(cells, 1, timeout: 300) do |cell|
        variant = cell[:variant]
        model = connect(variant.adapter, cell[:pool])
        open_connections(model, variant.name == "neverblock", cell[:pool])
        sleep_one = -> { model.connection_pool.with_connection { |conn| query(conn, format("select pg_sleep(%.3f)", @options[:ten_sleeps])) } }
        timed_jobs(variant, Array.new(10) { sleep_one })
      end
    end

    # Opens all `pool` connections before the clock starts (each costs
    # milliseconds of SCRAM): `pool` threads or tasks each take one, use it,
    # and hold it until all have one.
    def open_connections(model, tasks, pool)
      lock = Thread::Mutex.new
      ready = 0
      hold = lambda do
        model.connection_pool.with_connection do |conn|
          query(conn, "select 1")
          lock.synchronize { ready += 1 }
          deadline = NeverBlockBench.now + 30
          sleep(0.005) until lock.synchronize { ready } >= pool || NeverBlockBench.now > deadline
        end
      end
      tasks ? NeverBlock.run { NeverBlock.wait_all(Array.new(pool) { NeverBlock.spawn(&hold) }) } : Array.new(pool) { Thread.new(&hold) }.each(&:join)
      opened = model.connection_pool.connections.size
      raise "opened #{opened} of #{pool} connections before timing" if opened < pool
    end

    # `count` queries from `tasks` NeverBlock tasks, a connection per query.
    def concurrent(model, tasks, count, sql)
      NeverBlock.wait_all(NeverBlockBench.split(count, tasks).map do |share|
        NeverBlock.spawn { share.times { model.connection_pool.with_connection { |conn| query(conn, sql) } } }
      end)
    end

    # `execute` for pg_sleep, whose void result select_value would warn about (unknown OID 2278).
    def query(conn, sql) = sql.include?("pg_sleep") ? conn.execute(sql).clear : conn.select_value(sql)

    def find(cells, **fields) = cells.find { |cell| fields.all? { |key, value| cell[key] == value } }
    def seconds_text(cell) = cell&.median ? format("%.3f", cell.median) : "failed"
    def speedup(slow, fast) = slow&.median && fast&.median ? format("%.2fx", slow.median / fast.median) : "-"

    def report(cells)
      workloads, scaling, sleeps = ONLY.map { |part| cells.select { |cell| cell[:part] == part } }
      report_workloads(workloads) unless workloads.empty?
      report_scaling(scaling) unless scaling.empty?
      unless sleeps.empty?
        puts "\nTen concurrent `select pg_sleep(#{@options[:ten_sleeps]})` through ActiveRecord (one run each). " \
             "2009, through Rails and Thin: 10.25 s postgresql, 1.08 s neverblock_postgresql (9.5x)."
        puts Table.new(["client", "seconds", "vs blocking"], sleeps.map { |cell| [cell[:label], seconds_text(cell), speedup(sleeps.first, cell)] })
      end
      failures = cells.flat_map(&:failures).uniq
      puts "\nfailed runs: #{failures.join('; ')}" unless failures.empty?
      rows = cells.map do |cell|
        { "part" => cell[:part], "variant" => cell[:variant]&.name || "neverblock", "label" => cell[:label], "workload" => cell[:workload],
          "pool" => cell[:pool], "queries" => cell[:queries], "runs" => cell.listing(4), "median_s" => cell.median&.round(4),
          "per_s" => cell.median && (cell[:queries] / cell.median).round(1), "note" => cell.failures.first }
      end
      NeverBlockBench.write_results(@options[:out], "activerecord", rows, chart)
    end

    def report_workloads(cells)
      puts "\nWorkloads: #{@options[:units]} units each on #{@options[:rows]} rows; seconds, median of #{@options[:runs]} runs."
      puts @variants.map { |variant| "#{variant.name}: #{variant.label}" }.join("; ")
      table = Table.new(["workload"] + @variants.map { |variant| "#{variant.name} s" } + ["units/s NeverBlock", "NeverBlock vs blocking", "vs blocking_awake", "vs threads"])
      WORKLOADS.each do |workload, label|
        found = @variants.to_h { |variant| [variant.name, find(cells, workload: workload, variant: variant)] }
        nb = found["neverblock"]
        table << [label] + @variants.map { |variant| seconds_text(found[variant.name]) } +
                 [nb&.median ? format("%.0f", @options[:units] / nb.median) : "-"] + %w[blocking blocking_awake threads].map { |name| speedup(found[name], nb) }
      end
      puts table
    end

    def report_scaling(cells)
      puts "\nConnection scaling, neverblock_postgresql: #{@options[:sleeps]} concurrent `select pg_sleep(#{@options[:sleep_seconds]})`, " \
           "and #{@options[:selects]} `select 1` from 100 tasks; seconds, median of #{@options[:runs]} runs."
      table = Table.new(["pool", "#{@options[:sleeps]} x pg_sleep s", "ideal s", "#{@options[:selects]} x select 1 s", "runs (sleep; select)"])
      @options[:scaling_pools].each do |pool|
        slept, selected = %w[sleep select].map { |kind| find(cells, workload: kind, pool: pool) }
        table << [pool, seconds_text(slept), format("%.2f", (@options[:sleeps].to_f / pool).ceil * @options[:sleep_seconds]),
                  seconds_text(selected), "#{slept.listing}; #{selected.listing}"]
      end
      puts table
    end

    def chart
      chart = NeverBlockBench.chart("ActiveRecord #{Machine.gem_version('activerecord')} on NeverBlock",
                                    "#{Peers.text(@probe)}, #{PostgresServer.driver_description}",
                                    "workloads: #{@options[:threads]} threads or #{@options[:fibers]} tasks over " \
                                    "#{@options[:pool_size]} connections; ten sleeps: 10 threads or 10 tasks, pool 10")
      chart.pivot("#{@options[:units]} of each workload, seconds (lower is better)", "median_s", by: "workload", series: "variant",
                  where: { "part" => "workloads" })
      chart.pivot("connection scaling: #{@options[:sleeps]} x pg_sleep(#{@options[:sleep_seconds]}) and #{@options[:selects]} x select 1, " \
                  "seconds by pool size (lower is better)", "median_s", by: "pool", series: "workload", where: { "part" => "scaling" })
      chart.pivot("10 concurrent pg_sleep(#{@options[:ten_sleeps]}), seconds (lower is better)", "median_s", series: "label",
                  where: { "part" => "sleeps" })
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::ActiveRecordBench, "activerecord") if $PROGRAM_NAME == __FILE__
