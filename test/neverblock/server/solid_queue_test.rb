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

  def setup
    super
    skip "solid_queue needs Ruby 3.2+: it is in the Ruby 3.3 and 3.4 bundles only" unless solid_queue_in_bundle?
    @database = "nb_solid_queue_#{Process.pid}"
    admin { |conn| conn.exec("CREATE DATABASE #{conn.quote_ident(@database)}") }
    @url = pg_url.sub(%r{/[^/]*\z}, "/#{@database}")
    load_queue_schema
  end

  def teardown
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
    end
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
