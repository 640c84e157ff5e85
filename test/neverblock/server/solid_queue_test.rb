# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "tmpdir"
require "open3"

# Rails 8's Kamal deploy runs Solid Queue inside the web server
# (SOLID_QUEUE_IN_PUMA, which Puma's `plugin :solid_queue` reads): under
# `neverblock serve` the master supervises the app's real bin/jobs (Solid
# Queue's supervisor, with its own worker and dispatcher processes) against
# a real PostgreSQL, through NeverBlock's ActiveRecord adapter.
class ServerSolidQueueTest < PlainTest
  include ServeProcesses
  include NeverBlockTest::Databases

  APP = File.join(FIXTURES, "solid_queue_app")
  # The app whose bin/jobs runs a fiber worker (`fibers: 20`), and jobs that sleep, fail and wait in a query.
  FIBERS_APP = File.expand_path("../../fixtures/solid_queue_fibers", __dir__)
  TOKEN = "jobs-token"

  def setup
    super
    skip "solid_queue needs Ruby 3.2+: it is in the Ruby 3.3 and 3.4 bundles only" unless solid_queue_in_bundle?
    @database = "nb_solid_queue_#{Process.pid}"
    admin { |conn| conn.exec("CREATE DATABASE #{conn.quote_ident(@database)}") }
    @url = pg_url.sub(%r{/[^/]*\z}, "/#{@database}")
    load_queue_schema
  end

  def teardown
    # A supervised bin/jobs leads a process group of its own, which the
    # KILL that ends a failed test's server does not reach: left running, it
    # would keep forking workers for a dropped database.
    @supervisors&.each do |pid|
      Process.kill("KILL", -pid)
    rescue Errno::ESRCH, Errno::EPERM
      nil
    end
    super
    admin { |conn| conn.exec("DROP DATABASE IF EXISTS #{conn.quote_ident(@database)} WITH (FORCE)") } if @database
  end

  def test_solid_queue_in_puma_runs_jobs_in_a_supervised_bin_jobs
    Dir.mktmpdir do |dir|
      events = File.join(dir, "jobs")
      server = serve_app(env: { "SOLID_QUEUE_IN_PUMA" => "true", "DATABASE_URL" => @url, "JOB_EVENTS" => events })
      supervisor = supervisor_pid(server)
      3.times { |n| assert_equal "200", get(server, "/enqueue?n=#{n}").code }
      performed(events, %w[0 1 2])
      descendants = descendants_of(supervisor)
      refute_empty descendants, "Solid Queue's supervisor forked its worker and dispatcher"

      Process.kill("KILL", supervisor) # restarted by the master
      wait_for_line(server, /supervised `bin\/jobs` \(pid #{supervisor}\) exited \(signal KILL\)/)
      restarted = supervisor_pid(server, after: supervisor)
      assert_equal "200", get(server, "/enqueue?n=3").code
      performed(events, %w[0 1 2 3], timeout: 60)

      workers = worker_pids(server[:pid]) - [restarted]
      Process.kill("USR2", server[:pid]) # the workers are replaced, the jobs' supervisor is left alone
      eventually(timeout: 60) { (now = worker_pids(server[:pid]) - [restarted]).size == 2 && (now & workers).empty? }
      assert alive?(restarted)
      assert_equal 2, output_lines(server).join.scan(/supervising `bin\/jobs`/).size

      jobs_processes = [restarted] + descendants_of(restarted)
      Process.kill("TERM", server[:pid])
      assert wait_exit(server, timeout: 60).success?
      eventually { jobs_processes.none? { |pid| alive?(pid) } } # Solid Queue stopped its forks on TERM too
    end
  end

  # The master's /metrics shows the jobs of its supervised bin/jobs's fiber
  # worker: running now, ended by outcome (a job still in its query at the
  # shutdown timeout is cancelled), their durations; what a worker process
  # counted stays counted after it exits and bin/jobs is restarted.
  def test_metrics_show_the_jobs_of_the_supervised_bin_jobs
    Dir.mktmpdir do |dir|
      env = { "SOLID_QUEUE_IN_PUMA" => "true", "DATABASE_URL" => @url, "JOB_EVENTS" => File.join(dir, "events"),
              "SHUTDOWN_TIMEOUT" => "5", "RAILS_ENV" => "production" }
      server = serve("config.ru", "-w", "1", "--control", "tcp://127.0.0.1:0", "--control-token", TOKEN,
                     env: env, chdir: FIBERS_APP, timeout: 60)
      port = Integer(wait_for_line(server, /control listener on tcp:/)[/127\.0\.0\.1:(\d+)/, 1])
      supervisor = supervisor_pid(server)
      enqueue(env, "SleepJob", 2, 0.2)
      enqueue(env, "FailJob", 1)
      text = eventually(timeout: 60) do
        body = metrics(server, port)
        body if job_series(body).values_at("ok", "failed", "count") == [2, 1, 3]
      end
      assert_equal 0, job_series(text)["running"]
      assert_match(/^neverblock_job_duration_seconds_bucket\{le="\+Inf"\} 3$/, text)
      assert_operator Float(text[/^neverblock_job_duration_seconds_sum (\S+)$/, 1]), :>=, 0.4

      enqueue(env, "QueryJob", 1, 60)
      eventually(timeout: 30) { job_series(metrics(server, port))["running"] == 1 }
      Process.kill("TERM", supervisor) # Solid Queue stops its worker: the job is released and cancelled after 4 s
      supervisor_pid(server, after: supervisor) # the master restarted bin/jobs
      text = eventually(timeout: 30) do
        body = metrics(server, port)
        body if job_series(body)["cancelled"] == 1
      end
      assert_equal [0, 2, 1, 4], job_series(text).values_at("running", "ok", "failed", "count"),
                   "the exited worker's counts are kept (the cancelled job's time counted too)"
      if system("command -v promtool >/dev/null")
        output, status = Open3.capture2e("promtool", "check", "metrics", stdin_data: text)
        assert status.success?, "promtool check metrics:\n#{output}"
      end
    end
  end

  private

  # /metrics of the master. Reads what the server printed meanwhile: bin/jobs
  # logs every poll (the app's Rails logger is at debug), and a full pipe
  # would stop its worker in a write.
  def metrics(server, port)
    output_lines(server)
    @metrics = Net::HTTP.start("127.0.0.1", port, open_timeout: 5, read_timeout: 10) do |http|
      http.get("/metrics", { "authorization" => "Bearer #{TOKEN}" }).body
    end
  end

  # The server's lines without bin/jobs's DEBUG ones (its Rails logger
  # logs every poll), and the last /metrics read.
  def failure_context
    lines = @servers&.flat_map { |server| server[:out].closed? ? server[:lines] : output_lines(server) }
    "#{super}\n--- not DEBUG:\n#{lines&.grep_v(/ DEBUG -- /)&.last(40)&.join}" \
      "#{"\n--- the last /metrics:\n#{@metrics}" if @metrics}"
  end

  # @return [Hash{String => Numeric}] the job series of a /metrics text.
  def job_series(text)
    { "running" => text[/^neverblock_jobs_running (\d+)$/, 1],
      "ok" => text[/^neverblock_jobs_total\{outcome="succeeded"\} (\d+)$/, 1],
      "failed" => text[/^neverblock_jobs_total\{outcome="failed"\} (\d+)$/, 1],
      "cancelled" => text[/^neverblock_jobs_total\{outcome="cancelled"\} (\d+)$/, 1],
      "count" => text[/^neverblock_job_duration_seconds_count (\d+)$/, 1] }.transform_values { |value| value&.to_i }
  end

  def enqueue(env, job, count, argument = nil)
    output, status = Open3.capture2e(env, RbConfig.ruby, "bin/enqueue", job, count.to_s, *argument&.to_s,
                                     chdir: FIBERS_APP)
    assert status.success?, output
  end

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

  # Solid Queue's tables, from the schema its installer copies into an app.
  def load_queue_schema
    schema = File.join(Gem::Specification.find_by_name("solid_queue").gem_dir,
                       "lib/generators/solid_queue/install/templates/db/queue_schema.rb")
    code = 'require "active_record"; ActiveRecord::Base.establish_connection(ENV.fetch("DATABASE_URL")); ' \
           "ActiveRecord::Migration.verbose = false; load ARGV.fetch(0)"
    output, status = Open3.capture2e({ "DATABASE_URL" => @url }, RbConfig.ruby, "-e", code, schema)
    assert status.success?, output
  end

  def serve_app(env:)
    serve("config.ru", "-E", "production", "-w", "2", env: env, chdir: APP, timeout: 60)
  end

  def supervisor_pid(server, after: nil)
    pattern = /supervising `bin\/jobs` \(pid (\d+)\)/
    eventually(timeout: 30) do
      pids = output_lines(server).join.scan(pattern).flatten.map(&:to_i)
      pid = after ? pids[pids.index(after).to_i + 1] : pids.first
      pid if pid && pid != after
    end.tap { |pid| (@supervisors ||= []) << pid }
  end

  def performed(events, numbers, timeout: 30)
    eventually(timeout: timeout) do
      File.exist?(events) && File.read(events).scan(/^performed (\d+)/).flatten.sort == numbers
    end
  end

  def descendants_of(pid)
    children = worker_pids(pid)
    children + children.flat_map { |child| descendants_of(child) }
  end
end
