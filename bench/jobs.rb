#!/usr/bin/env ruby
# frozen_string_literal: true

# Jobs that wait on a slow API, drained by Solid Queue: --jobs LlmCallJobs
# (support/jobs_app, a Rails app), each a Net::HTTP GET of a fake LLM API
# (support/jobs_upstream.ru under `neverblock serve -w 0`, its own process,
# not counted) that answers after --wait s, run by one `bin/jobs` (Solid
# Queue's supervisor, one worker process and a dispatcher) on PostgreSQL:
# threads: --threads (Solid Queue's default, 3), fibers: --fibers on the
# async gem's reactor (Solid Queue's own fiber pool: an app without
# NeverBlock), fibers: --fibers with NeverBlock loaded (its Railtie gives the
# worker NeverBlock::SolidQueue::FiberPool, and the app NeverBlock's
# PostgreSQL adapter). Per variant, a fresh database and bin/jobs: once its
# worker has registered, the jobs are enqueued at once (one bulk insert);
# drain: from the end of that insert to the last job's finished_at; the most
# connections bin/jobs's processes had to the database at once
# (pg_stat_activity, sampled every 0.1 s); the worker process's peak RSS
# (VmHWM); the CPU (user + sys) of bin/jobs's processes from the enqueue to
# the drain, per job; the most calls the API held at once. fleet: three
# such bin/jobs (fibers on NeverBlock) whose calls share a
# NeverBlock::RedisSemaphore of --limit permits (50): the API must never hold
# more than that.
#
#   bench/run --ruby 3.4-yjit jobs            -> bench/results/ruby34-yjit/jobs.{txt,csv,svg} (about 25 minutes:
#                                                threads: 3 takes jobs * wait / 3 s)
#   bench/run --ruby 3.4-yjit jobs --quick    200 jobs of 1 s; threads: 3 on 30 of them
#   bench/run --ruby 3.4-yjit jobs --jobs 30 --wait 0.3 --only async,neverblock

require_relative "support/harness"
require "net/http"
require "open3"
require "rbconfig"
require_relative "support/servers"
require_relative "support/postgres"

module NeverBlockBench
  class JobsBench < Bench
    # threads_jobs: the jobs of the threads: variant (0: --jobs), which takes jobs * wait / threads s.
    DEFAULTS = { jobs: 2000, wait: 2.0, threads: 3, fibers: 200, threads_jobs: 0, pool: 10, limit: 50 }.freeze
    QUICK = { jobs: 200, wait: 1.0, threads_jobs: 30 }.freeze
    ONLY = %w[threads async neverblock fleet].freeze # the executions
    FLEET = 3 # bin/jobs processes of the fleet part
    APP = File.expand_path("support/jobs_app", __dir__)
    UPSTREAM = File.expand_path("support/jobs_upstream.ru", __dir__)
    APPLICATION_NAME = "neverblock-bench-jobs" # bin/jobs's connections (PGAPPNAME), as counted in pg_stat_activity
    SAMPLE_INTERVAL = 0.1 # seconds
    COLUMNS = ["execution", "jobs", "wait s", "drain s", "ideal s", "API most at once", "DB connections", "worker RSS MB", "CPU ms/job",
               "failed", "note"].freeze

    # @return [Boolean] true when every variant drained all its jobs without a failure
    def call
      return warn(PostgresServer.problem) if PostgresServer.problem

      puts header
      upstream = PeerServers.neverblock(UPSTREAM, args: %w[-w 0 --no-adaptive-limit], name: "fake LLM API").tap(&:wait_until_ready)
      rows = @options[:only].map { |execution| measure(execution, upstream.port) }
      report(rows)
      rows.all? { |row| row["note"].to_s !~ /\Afailed|not drained/ && row["failed"].to_i.zero? }
    ensure
      upstream&.stop
    end

    private

    def header
      NeverBlockBench.header(
        "# Jobs that wait on an API: #{@options[:jobs]} jobs of #{@options[:wait]} s, drained by Solid Queue",
        "#{Checkout.description}; solid_queue #{Machine.gem_version('solid_queue')}, rails #{Machine.gem_version('railties')}, " \
        "async #{Machine.gem_version('async')}, #{PostgresServer.driver_description}",
        "PostgreSQL: #{PostgresServer.description}",
        <<~TEXT.chomp
          A job: Net::HTTP GET of a fake LLM API (neverblock serve -w 0, its own process, not counted) that answers after the wait.
          bin/jobs: Solid Queue's supervisor, one worker process (polling 0.1 s) and a dispatcher; ActiveRecord pool #{@options[:pool]}
          per process. threads: Solid Queue's thread pool, Rails' postgresql adapter, no NeverBlock; fibers (async): Solid Queue's
          fiber pool on the async gem's reactor, isolation_level :fiber, no NeverBlock; fibers (NeverBlock): NeverBlock loaded
          (NeverBlock::SolidQueue::FiberPool, the neverblock_postgresql adapter); fleet: #{FLEET} such bin/jobs, each call holding a
          permit of one NeverBlock::RedisSemaphore of #{@options[:limit]} (Redis).
          drain: from the enqueue (one bulk insert, once the worker is up) to the last job's finished_at; ideal: jobs * wait /
          concurrency; DB connections: the most bin/jobs held at once (pg_stat_activity, sampled every #{SAMPLE_INTERVAL} s);
          worker RSS: the worker process's peak (VmHWM; the largest of the fleet's); CPU: bin/jobs's processes' user+sys from the
          enqueue to the drain, per job; API most at once: the most calls the fake API held at once.
        TEXT
      )
    end

    def label(execution)
      case execution
      when "threads" then "threads: #{@options[:threads]}"
      when "fleet" then "#{FLEET} x fibers: #{@options[:fibers]} (NeverBlock), RedisSemaphore #{@options[:limit]}"
      else "fibers: #{@options[:fibers]} (#{execution == 'async' ? 'async' : 'NeverBlock'})"
      end
    end

    # Jobs at once: what bounds the drain.
    def concurrency(execution)
      case execution
      when "threads" then @options[:threads]
      when "fleet" then [@options[:limit], FLEET * @options[:fibers]].min
      else @options[:fibers]
      end
    end

    def job_count(execution)
      execution == "threads" && @options[:threads_jobs].positive? ? [@options[:threads_jobs], @options[:jobs]].min : @options[:jobs]
    end

    # A fresh database and bin/jobs; enqueues, samples until drained. @return [Hash] the CSV row
    def measure(execution, upstream_port)
      jobs = job_count(execution)
      warn "#{label(execution)}: #{jobs} jobs of #{@options[:wait]} s"
      ideal = (jobs.fdiv(concurrency(execution)).ceil * @options[:wait]).round(1)
      row = { "execution" => label(execution), "jobs" => jobs, "wait s" => @options[:wait], "ideal s" => ideal,
              "note" => ("#{jobs} of the #{@options[:jobs]} jobs (--threads-jobs): it takes jobs * wait / #{@options[:threads]} s" if jobs < @options[:jobs]) }
      with_database do |url|
        env = { "DATABASE_URL" => url, "NB_JOBS_EXECUTION" => execution == "fleet" ? "neverblock" : execution,
                "NB_JOBS_CONCURRENCY" => (execution == "threads" ? @options[:threads] : @options[:fibers]).to_s,
                "NB_JOBS_POOL" => @options[:pool].to_s, "NB_JOBS_UPSTREAM" => "http://127.0.0.1:#{upstream_port}",
                "RAILS_ENV" => "production", "BUNDLE_GEMFILE" => ENV.fetch("BUNDLE_GEMFILE", nil) }.compact
        if execution == "fleet"
          env.merge!("NB_JOBS_LIMIT" => @options[:limit].to_s, "NB_JOBS_RUN" => Process.pid.to_s,
                     "REDIS_URL" => ENV.fetch("NEVERBLOCK_REDIS_URL") { raise "the fleet part needs Redis: run it under bench/run" })
        end
        workers = Array.new(execution == "fleet" ? FLEET : 1) do |index|
          ServerProcess.start("bin/jobs #{execution} #{index}", [RbConfig.ruby, File.join(APP, "bin/jobs")], port: nil,
                                                                                                          env: env.merge("PGAPPNAME" => APPLICATION_NAME))
        end
        begin
          row.merge!(drain(workers, url, env, jobs, upstream_port, deadline: (ideal * 3) + 60))
        ensure
          workers.each(&:stop)
        end
      end
      warn "  drained in #{row['drain s']} s (ideal #{ideal} s), #{row['DB connections']} connections, worker #{row['worker RSS MB']} MB"
      row
    rescue StandardError => e
      warn "  #{execution} failed: #{e.class}: #{e.message}"
      row.merge("note" => "failed: #{e.class}: #{e.message.lines.first&.strip}")
    end

    # A database of its own with Solid Queue's tables, dropped after the block. Yields its URL.
    def with_database
      name = "nb_bench_jobs_#{Process.pid}"
      PostgresServer.connect do |conn|
        conn.exec("SET client_min_messages TO warning") # not "does not exist, skipping"
        conn.exec("DROP DATABASE IF EXISTS #{name} WITH (FORCE)")
        conn.exec("CREATE DATABASE #{name}")
      end
      info = PostgresServer.conninfo
      url = "postgresql://#{info[:user]}:#{info[:password]}@#{info[:host]}:#{info[:port]}/#{name}"
      schema = File.join(Gem::Specification.find_by_name("solid_queue").gem_dir, "lib/generators/solid_queue/install/templates/db/queue_schema.rb")
      code = 'require "active_record"; ActiveRecord::Base.establish_connection(ENV.fetch("DATABASE_URL")); ' \
             "ActiveRecord::Migration.verbose = false; load ARGV.fetch(0)"
      output, status = Open3.capture2e({ "DATABASE_URL" => url }, RbConfig.ruby, "-e", code, schema)
      raise "loading Solid Queue's schema failed: #{output.lines.last(3).join.strip}" unless status.success?

      yield url
    ensure
      PostgresServer.connect { |conn| conn.exec("DROP DATABASE IF EXISTS #{name} WITH (FORCE)") }
    end

    # Waits for the workers, enqueues `jobs`, samples until every job finished. @return [Hash] the row's numbers
    def drain(workers, url, env, jobs, upstream_port, deadline:)
      PG.connect(url) do |db|
        wait_for_workers(workers, db)
        cpu = workers.sum { |worker| ProcessCpu.session_seconds(worker.pid) }
        most_at_once(upstream_port) # (resets the API's count)
        enqueued, status = Open3.capture2e(env, RbConfig.ruby, File.join(APP, "bin/enqueue"), jobs.to_s, @options[:wait].to_s)
        raise "bin/enqueue failed: #{enqueued.lines.last(3).join.strip}" unless status.success?

        enqueued_at = Float(enqueued.lines.last)
        connections = 0
        until (finished = db.exec("SELECT count(*) AS n FROM solid_queue_jobs WHERE finished_at IS NOT NULL").first["n"].to_i) == jobs
          workers.each { |worker| raise "bin/jobs exited:\n#{worker.log_tail}" if worker.exited? }
          break if Time.now.to_f - enqueued_at > deadline

          connections = [connections, connection_count(db, url)].max
          sleep SAMPLE_INTERVAL
        end
        cpu = workers.sum { |worker| ProcessCpu.session_seconds(worker.pid) } - cpu
        last = db.exec("SELECT extract(epoch FROM max(finished_at)) AS at FROM solid_queue_jobs").first["at"].to_f
        failed = db.exec("SELECT count(*) AS n FROM solid_queue_failed_executions").first["n"].to_i
        { "drain s" => (finished == jobs ? (last - enqueued_at).round(2) : "not drained"),
          "API most at once" => most_at_once(upstream_port), "DB connections" => connections,
          "worker RSS MB" => (workers.map { |worker| worker_peak_rss_kb(worker.pid) }.max / 1024.0).round(1),
          "CPU ms/job" => (cpu * 1000 / jobs).round(2), "failed" => failed,
          **({ "note" => "not drained: #{finished}/#{jobs} finished after #{deadline.round} s" } unless finished == jobs) }
      end
    end

    # Until every bin/jobs's worker process has registered itself.
    def wait_for_workers(workers, db, timeout: 60)
      started = NeverBlockBench.now
      until db.exec("SELECT count(*) AS n FROM solid_queue_processes WHERE kind = 'Worker'").first["n"].to_i >= workers.size
        workers.each { |worker| raise "bin/jobs exited before its worker started:\n#{worker.log_tail}" if worker.exited? }
        raise "no worker within #{timeout} s:\n#{workers.first.log_tail}" if NeverBlockBench.now - started > timeout

        sleep 0.1
      end
    end

    # The most calls the fake API held at once since the last ask (which this resets).
    def most_at_once(port)
      Integer(Net::HTTP.get(URI("http://127.0.0.1:#{port}/most")))
    end

    # bin/jobs's connections to the bench's database now.
    def connection_count(db, url)
      db.exec_params("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
                     [URI(url).path.delete_prefix("/"), APPLICATION_NAME]).first["n"].to_i
    end

    # The peak RSS of the session's worker process (Solid Queue titles it "solid-queue-worker...").
    def worker_peak_rss_kb(session)
      ProcessCpu.in_session(session) do |dir, _|
        File.read("#{dir}/status")[/^VmHWM:\s+(\d+)/, 1].to_i if File.read("#{dir}/cmdline").start_with?("solid-queue-worker")
      end.max || 0
    end

    def report(rows)
      puts "\n#{Table.of(rows, COLUMNS, left: %w[execution note])}"
      chart = NeverBlockBench.chart("Jobs that wait on an API, drained by Solid Queue", "#{@options[:jobs]} jobs of #{@options[:wait]} s each; by execution")
      chart.pivot("Time to drain, s (lower is better)", "drain s", series: "execution", log: true)
      chart.pivot("Database connections at the peak", "DB connections", series: "execution")
      chart.pivot("Worker process's peak RSS, MB", "worker RSS MB", series: "execution")
      chart.pivot("CPU per job (bin/jobs's processes), ms", "CPU ms/job", series: "execution")
      NeverBlockBench.write_results(@options[:out], "jobs", rows, chart)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::JobsBench, "jobs") if $PROGRAM_NAME == __FILE__
