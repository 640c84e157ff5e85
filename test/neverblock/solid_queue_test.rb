# frozen_string_literal: true

require_relative "../test_helper"
require "tmpdir"
require "open3"
require "json"

# Solid Queue's fiber workers (`fibers: 20`) on NeverBlock's loop
# (NeverBlock::SolidQueue::FiberPool): a real `bin/jobs` (Solid Queue's
# supervisor, forking its worker and dispatcher) of a Rails app against a
# real PostgreSQL, through NeverBlock's ActiveRecord adapter. The app's
# jobs note what they see in an events file, a JSON line each.
class SolidQueueFiberPoolTest < PlainTest
  include NeverBlockTest::Databases

  APP = File.expand_path("../fixtures/solid_queue_fibers", __dir__)

  def setup
    super
    skip "solid_queue needs Ruby 3.2+: it is in the Ruby 3.3 and 3.4 bundles only" unless solid_queue_in_bundle?
    @database = "nb_sq_fibers_#{Process.pid}"
    admin { |conn| conn.exec("CREATE DATABASE #{conn.quote_ident(@database)}") }
    @url = pg_url.sub(%r{/[^/]*\z}, "/#{@database}")
    @dir = Dir.mktmpdir
    @events = File.join(@dir, "events")
    @log = File.join(@dir, "jobs.log")
    load_queue_schema
  end

  def teardown
    if @jobs
      begin
        Process.kill("KILL", -@jobs)
        Process.wait(@jobs)
      rescue Errno::ESRCH, Errno::ECHILD
        nil
      end
    end
    admin { |conn| conn.exec("DROP DATABASE IF EXISTS #{conn.quote_ident(@database)} WITH (FORCE)") } if @database
    FileUtils.rm_rf(@dir) if @dir
    super
  end

  def failure_context
    @log && File.exist?(@log) ? "\n--- bin/jobs output:\n#{File.read(@log)[-4000..] || File.read(@log)}" : ""
  end

  def test_only_fiber_workers_get_neverblocks_pool_and_only_with_neverblock_loaded
    app = 'require "rails"; require "active_record"; require "solid_queue"'
    pools = "p(%i[fiber thread].map { |type| SolidQueue::Pool.build(type: type, size: 2).class })"
    assert_equal "[SolidQueue::FiberPool, SolidQueue::ThreadPool]\n", child_ruby("#{app}; #{pools}")
    assert_equal "[NeverBlock::SolidQueue::FiberPool, SolidQueue::ThreadPool]\n",
                 child_ruby(%(#{app}; require "neverblock/solid_queue"; #{pools}))
  end

  def test_twenty_waiting_jobs_run_at_once_each_in_a_neverblock_task_without_async
    enqueue("SleepJob", 20, 1)
    start_jobs
    finished = eventually(timeout: 60) { (found = events("finished")).size == 20 && found }
    started = events("started")

    assert_equal (0...20).to_a, started.map { |event| event["number"] }.sort
    assert(started.all? { |event| event["task"] }, "every job runs in a NeverBlock task")
    assert_equal ["NeverBlock::Scheduler"], started.map { |event| event["scheduler"] }.uniq
    assert_equal [nil], started.map { |event| event["async"] }.uniq, "the async gem is not loaded"
    assert_operator finished.map { |event| event["at"] }.max - started.map { |event| event["at"] }.min, :<, 10,
                    "20 one-second jobs drained in well under 20 s"
    assert_operator most_at_once(started, finished), :>, 1, "jobs overlapped"
    eventually { count("solid_queue_jobs WHERE finished_at IS NOT NULL") == 20 }
    assert_match(/"pool_type":"fiber","pool_size":20/, worker_metadata)
  end

  def test_a_task_a_job_spawns_is_cancelled_when_the_job_ends
    enqueue("SpawnJob", 1)
    start_jobs
    child = eventually(timeout: 60) { events("child ended").first }

    assert_equal "NeverBlock::Cancelled", child["error"], "the child did not wait out its 60 s"
    assert_equal 1, events("finished").size
    eventually { count("solid_queue_jobs WHERE finished_at IS NOT NULL") == 1 }
  end

  def test_the_stall_detector_names_the_job_that_holds_the_loop
    enqueue("BusyJob", 1, 1)
    start_jobs
    eventually(timeout: 60) { events("finished").any? }

    job_id = query("SELECT id FROM solid_queue_jobs WHERE class_name = 'BusyJob'")
    stall = eventually { File.read(@log)[/.*has held the event loop.*/] }
    assert_match(/Solid Queue job #{job_id} \(BusyJob\).* has held the event loop/, stall)
  end

  def test_term_lets_a_job_that_ends_within_the_shutdown_timeout_finish
    enqueue("SleepJob", 1, 2)
    start_jobs(shutdown_timeout: 20)
    eventually(timeout: 60) { events("started").any? }
    Process.kill("TERM", @jobs)
    assert stopped_jobs.success?

    assert_equal [nil], events("ended").map { |event| event["error"] }
    assert_equal 1, events("finished").size
    assert_equal 1, count("solid_queue_jobs WHERE finished_at IS NOT NULL")
    assert_equal 0, count("solid_queue_claimed_executions")
    assert_equal 0, count("solid_queue_failed_executions")
  end

  def test_term_releases_and_cancels_a_job_still_in_its_query_at_the_shutdown_timeout
    enqueue("QueryJob", 1, 60)
    start_jobs(shutdown_timeout: 3)
    eventually(timeout: 60) { events("started").any? }
    eventually { sleeping_queries == 1 }
    Process.kill("TERM", @jobs)
    stopped_jobs

    assert_equal ["NeverBlock::Cancelled"], events("ended").map { |event| event["error"] }
    assert_empty events("finished")
    assert_equal 0, sleeping_queries, "the job's query was cancelled on the server, not left to run out its 60 s"
    assert_equal 0, count("solid_queue_claimed_executions")
    assert_equal 0, count("solid_queue_failed_executions"), "released, not recorded as failed"
    assert_equal 1, count("solid_queue_ready_executions"), "ready for another worker"
    assert_equal 0, count("solid_queue_jobs WHERE finished_at IS NOT NULL")
  end

  # NeverBlock::SolidQueue.stats, what a bin/jobs without a NeverBlock
  # server has: read by a job in the worker process, after jobs that
  # succeeded and one that failed.
  def test_stats_count_the_worker_processs_jobs_by_outcome_with_their_durations
    enqueue("SleepJob", 3, 0.5)
    enqueue("FailJob", 1)
    start_jobs
    eventually(timeout: 60) { events("ended").size == 3 && count("solid_queue_failed_executions") == 1 }
    eventually { count("solid_queue_claimed_executions").zero? } # the failed job's end is counted too
    enqueue("StatsJob", 1)
    stats = eventually(timeout: 30) { events("stats").first }

    assert_equal({ "running" => 1, "succeeded" => 3, "failed" => 1, "cancelled" => 0 },
                 stats.slice("running", "succeeded", "failed", "cancelled"), "the StatsJob itself is running")
    duration = stats.fetch("duration")
    assert_equal 4, duration["count"]
    assert_equal 4, duration["counts"].sum
    assert_equal duration["buckets"].size + 1, duration["counts"].size
    assert_operator duration["sum"], :>=, 1.5, "three jobs slept 0.5 s each"
    assert_operator duration["sum"], :<, 30
  end

  private

  def solid_queue_in_bundle?
    defined?(Bundler) && Bundler.locked_gems.specs.any? { |spec| spec.name == "solid_queue" }
  end

  def admin
    require "pg"
    conn = PG.connect(**pg_conninfo)
    yield conn
  ensure
    conn&.close
  end

  def app_env(extra = {})
    { "DATABASE_URL" => @url, "JOB_EVENTS" => @events, "RAILS_ENV" => "production" }.merge(extra)
  end

  # Solid Queue's tables, from the schema its installer copies into an app.
  def load_queue_schema
    schema = File.join(Gem::Specification.find_by_name("solid_queue").gem_dir,
                       "lib/generators/solid_queue/install/templates/db/queue_schema.rb")
    code = 'require "active_record"; ActiveRecord::Base.establish_connection(ENV.fetch("DATABASE_URL")); ' \
           "ActiveRecord::Migration.verbose = false; load ARGV.fetch(0)"
    output, status = Open3.capture2e({ "DATABASE_URL" => @url }, RbConfig.ruby, "-e", code, schema)
    assert status.success?, output
  end

  # Runs `code` in a new Ruby of this bundle; returns its output.
  def child_ruby(code)
    output, status = Open3.capture2e(RbConfig.ruby, "-I", File.expand_path("../../lib", __dir__), "-e", code)
    assert status.success?, output
    output
  end

  def enqueue(job, count, argument = nil)
    output, status = Open3.capture2e(app_env, RbConfig.ruby, "bin/enqueue", job, count.to_s, *argument&.to_s,
                                     chdir: APP)
    assert status.success?, output
  end

  # bin/jobs in a process group of its own, its output in @log.
  def start_jobs(shutdown_timeout: 5)
    @jobs = Process.spawn(app_env("SHUTDOWN_TIMEOUT" => shutdown_timeout.to_s), RbConfig.ruby, "bin/jobs",
                          chdir: APP, out: @log, err: %i[child out], pgroup: true)
  end

  def stopped_jobs(timeout: 60)
    status = eventually(timeout: timeout) { Process.wait2(@jobs, Process::WNOHANG)&.last }
    @jobs = nil
    status
  end

  def events(name)
    return [] unless File.exist?(@events)

    File.readlines(@events).filter_map do |line|
      event, json = line.split(" {", 2)
      JSON.parse("{#{json}") if event == name
    end
  end

  # The most jobs in flight at one time, by their started/finished events.
  def most_at_once(started, finished)
    moments = started.map { |event| [event["at"], 1] } + finished.map { |event| [event["at"], -1] }
    moments.sort.reduce([0, 0]) { |(now, most), (_, step)| [now + step, [most, now + step].max] }.last
  end

  def count(from)
    query("SELECT count(*) FROM #{from}").to_i
  end

  def worker_metadata
    query("SELECT metadata FROM solid_queue_processes WHERE kind = 'Worker'").to_s
  end

  def sleeping_queries
    admin do |conn|
      conn.exec_params("SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND query LIKE 'SELECT pg_sleep%'",
                [@database]).getvalue(0, 0).to_i
    end
  end

  def query(sql)
    conn = PG.connect(**pg_conninfo.merge(dbname: @database))
    conn.exec(sql).getvalue(0, 0)
  ensure
    conn&.close
  end
end
