# frozen_string_literal: true

# One run of ActiveRecord's own test suite for bin/activerecord-suite: the
# PostgreSQL adapter's test set (what `rake test:postgresql` runs in Rails'
# activerecord/ directory) in one process, with one result per test written
# as a JSON line. Started by bin/activerecord-suite as
#
#   cd <rails source>/activerecord && bundle exec ruby -w -Itest runner.rb [minitest options]
#
# under ruby31.gemfile or ruby33.gemfile beside it, so ActiveRecord is the
# bundled gem, not the source's lib (unless ARSUITE_AGAINST=source).
#
# Environment:
#   ARSUITE_MODE     postgresql | neverblock_postgresql, with "+fibers" to
#                    run each test inside its own NeverBlock.run and
#                    "+neverblock" to load neverblock/active_record (which
#                    sets Active Support's isolation level to :fiber) with
#                    the stock adapter
#   ARSUITE_RESULTS  the JSON-lines file to write (one object per test, then
#                    one {"finished": ...})
#   ARSUITE_FILES    comma-separated globs (relative to activerecord/); empty
#                    means the whole PostgreSQL test set
#   ARSUITE_AGAINST  "source": load activerecord, activemodel and
#                    activesupport from the source tree instead of the gems
#   NEVERBLOCK_PG_*  the server (bin/lib/databases.sh); the role must be
#                    allowed to create databases and extensions
#
# Minitest options (--seed, -n, -v) pass through ARGV.

require "json"
require "yaml"
require "fileutils"
require "minitest"

module ARSuite
  # The databases the suite's config names (test/support/config.rb).
  DATABASES = %w[activerecord_unittest activerecord_unittest2].freeze

  module_function

  def mode
    @mode ||= ENV.fetch("ARSUITE_MODE", "postgresql")
  end

  # @return [String] the adapter name written into the suite's database.yml.
  def adapter
    mode.split("+").first
  end

  def flags
    mode.split("+").drop(1)
  end

  # @return [Boolean] whether each test runs inside its own NeverBlock.run.
  def fibers?
    flags.include?("fibers")
  end

  # @return [Boolean] whether neverblock/active_record is loaded (always for
  #   a neverblock adapter; "+neverblock" loads it for the stock adapter).
  def neverblock_active_record?
    adapter.start_with?("neverblock_") || flags.include?("neverblock")
  end

  def server
    {
      "host" => ENV.fetch("NEVERBLOCK_PG_HOST"),
      "port" => Integer(ENV.fetch("NEVERBLOCK_PG_PORT")),
      "username" => ENV.fetch("NEVERBLOCK_PG_USER"),
      "password" => ENV.fetch("NEVERBLOCK_PG_PASSWORD")
    }
  end

  # Fresh, empty databases for each run, as Rails' `db:postgresql:rebuild`
  # makes them (UTF-8 from template0), so no run sees another's leftovers.
  def recreate_databases
    require "pg"
    conn = PG.connect(host: server["host"], port: server["port"], user: server["username"],
                      password: server["password"], dbname: ENV.fetch("NEVERBLOCK_PG_DATABASE"))
    conn.exec("SET client_min_messages TO warning") # no NOTICE for a database that is not there
    DATABASES.each do |name|
      conn.exec("DROP DATABASE IF EXISTS #{conn.quote_ident(name)} WITH (FORCE)")
      conn.exec("CREATE DATABASE #{conn.quote_ident(name)} ENCODING 'UTF8' TEMPLATE template0")
    end
  ensure
    conn&.close
  end

  # The suite reads its connections from ARCONFIG (test/support/config.rb)
  # and uses the one named ARCONN: the server and options of the example
  # config's postgresql entry, with `adapter:` this mode's. The entry is also
  # written under "postgresql" (a few tests read that one by name) as a copy
  # of its own: YAML would write one hash twice as an alias, and the suite,
  # which fills in each entry's adapter from its name, would then give both
  # the first name.
  def write_config(path)
    entry = lambda do |name, extra = {}|
      server.merge("adapter" => name, "min_messages" => "warning").merge(extra)
    end
    connection = lambda do |name|
      {
        "arunit" => entry.call(name),
        "arunit_without_prepared_statements" => entry.call(name, "prepared_statements" => false),
        "arunit2" => entry.call(name)
      }
    end
    connections = { "postgresql" => connection.call("postgresql"), adapter => connection.call(adapter) }
    File.write(path, YAML.dump("default_connection" => adapter, "connections" => connections))
    ENV["ARCONFIG"] = File.expand_path(path)
    ENV["ARCONN"] = adapter
    # For the tests that run psql/pg_dump or connect with libpq's defaults.
    ENV["PGHOST"] = server["host"]
    ENV["PGPORT"] = server["port"].to_s
    ENV["PGUSER"] = server["username"]
    ENV["PGPASSWORD"] = server["password"]
  end

  # The test files of `rake test:postgresql` (activerecord/Rakefile), or the
  # ARSUITE_FILES globs.
  def test_files
    globs = ENV.fetch("ARSUITE_FILES", "").split(",").map(&:strip).reject(&:empty?)
    files =
      if globs.empty?
        Dir["test/cases/**/*_test.rb"].reject { |f| f.include?("/adapters/") || f.include?("/encryption/performance") } +
          Dir["test/cases/adapters/postgresql/**/*_test.rb"]
      else
        globs.flat_map { |glob| Dir[glob] }
      end
    abort "ARSUITE_FILES matched no test files: #{globs.join(', ')}" if files.empty?
    files.sort.uniq
  end

  # Records every result as it comes, so a run that dies part way still
  # leaves the results of the tests it finished.
  class Recorder < Minitest::AbstractReporter
    def initialize(path)
      super()
      @io = File.open(path, "w")
      @io.sync = true
      @seen = Hash.new(0)
    end

    def record(result)
      failure = result.failures.first
      # A few classes share a name (defined in two files): the second one's
      # tests get " [2]", and so on, in the order they ran.
      name = "#{result.klass}##{result.name}"
      @seen[name] += 1
      name = "#{name} [#{@seen[name]}]" if @seen[name] > 1
      @io.puts JSON.generate(
        "test" => name,
        "outcome" => outcome(result),
        "location" => Array(result.source_location).join(":"),
        "time" => result.time.round(4),
        "message" => failure && message(failure)
      )
    end

    def report
      @io.puts JSON.generate("finished" => true)
      @io.close
    end

    private

    def outcome(result)
      if result.skipped? then "skip"
      elsif result.error? then "error"
      elsif result.passed? then "pass"
      else "fail"
      end
    end

    # The first line of the failure (for an error: its class and message),
    # enough to tell two runs' failures apart.
    def message(failure)
      error = failure.respond_to?(:error) ? failure.error : failure
      text = failure.is_a?(Minitest::UnexpectedError) ? "#{error.class}: #{error.message}" : failure.message
      line = text.to_s.lines.map(&:strip).reject(&:empty?).first.to_s
      line.length > 300 ? "#{line[0, 297]}..." : line
    end
  end

  # Rails' leak check (ActiveRecord::TestCase#check_connection_leaks) lets a
  # query still running on the async executor (load_async) finish by
  # joining its connection's owner for 0.5 s when the owner is a Thread. At
  # the :fiber isolation level the owner is a fiber, which has no #join: the
  # executor thread's, or under neverblock/active_record the NeverBlock task's
  # that runs the query (NeverBlock::ActiveRecord::AsyncQueries, which the
  # executor's counts do not see). So the check would report the query about
  # to finish as a leaked connection (and then fail on Fiber#kill). This
  # gives those queries the same 0.5 s first: the executor's tasks, and any
  # connection checked out to another fiber that is still alive. A
  # connection that is never given back is still reported.
  module AsyncQueriesFinishFirst
    def check_connection_leaks
      if ::ActiveSupport::IsolatedExecutionState.isolation_level == :fiber
        deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + 0.5
        ::ActiveRecord::Base.connection_handler.each_connection_pool do |pool|
          while (executor_busy?(pool) || held_by_another_fiber?(pool)) &&
                Process.clock_gettime(Process::CLOCK_MONOTONIC) < deadline
            sleep(0.005)
          end
        end
      end
      super
    end

    private

    def executor_busy?(pool)
      executor = pool.async_executor or return false
      executor.scheduled_task_count != executor.completed_task_count
    end

    def held_by_another_fiber?(pool)
      current = Fiber.current
      pool.connections.any? do |conn|
        owner = conn.owner
        conn.in_use? && owner.is_a?(Fiber) && !owner.equal?(current) && owner.alive?
      end
    end
  end

  # The suite's leak check (ActiveRecord::TestCase#check_connection_leaks)
  # counts every connection leased to another thread or fiber as leaked, and
  # the main fiber leases one between tests (helper.rb's QUOTED_TYPE, the
  # `current_adapter?` in PostgreSQLTestCase.run): it is given back before
  # each test, as a Rails executor gives back a request's connection. Under
  # :thread isolation the main fiber and the tests share one lease, and
  # giving it back changes nothing.
  module InsideNeverBlock
    def run_one_method(klass, method_name)
      ::ActiveRecord::Base.connection_handler.each_connection_pool(&:release_connection)
      NeverBlock.run { super }
    end
  end
end

if ENV["ARSUITE_AGAINST"] == "source"
  %w[../activesupport/lib ../activemodel/lib lib].each { |dir| $LOAD_PATH.unshift(File.expand_path(dir)) }
end

ARSuite.recreate_databases
FileUtils.mkdir_p("tmp")
ARSuite.write_config("tmp/arsuite-#{ARSuite.adapter}.yml")

require "neverblock/active_record" if ARSuite.neverblock_active_record?
if ARSuite.fibers?
  require "neverblock"
  Minitest.singleton_class.prepend(ARSuite::InsideNeverBlock)
end

results = ENV.fetch("ARSUITE_RESULTS")
Minitest.extensions << "ar_suite_recorder"
Minitest.define_singleton_method(:plugin_ar_suite_recorder_init) do |_options|
  reporter << ARSuite::Recorder.new(results)
end

warn "ar_suite: #{ARSuite.mode} (adapter #{ARSuite.adapter}#{', each test in NeverBlock.run' if ARSuite.fibers?}" \
     "#{', isolation level :fiber' if ARSuite.neverblock_active_record?}), " \
     "ActiveRecord from #{ENV['ARSUITE_AGAINST'] == 'source' ? 'the source tree' : 'the bundle'}"
ARSuite.test_files.each { |file| require File.expand_path(file) }
# helper.rb sets Thread.abort_on_exception, which raises a thread's error in
# the main thread's current fiber: under NeverBlock.run that is the event
# loop, not the test (waiting in Thread#join to see the error), and the
# error would end the whole run. Thread#join still raises it in the test.
Thread.abort_on_exception = false if ARSuite.fibers?
ActiveRecord::TestCase.prepend(ARSuite::AsyncQueriesFinishFirst)

# The suite connected while loading (ARTest.connect): make sure it is
# through the adapter this mode is about.
connection_class = ActiveRecord::Base.connection_pool.with_connection(&:class)
expected_class = ARSuite.adapter == "postgresql" ? "ActiveRecord::ConnectionAdapters::PostgreSQLAdapter" :
  "NeverBlock::ActiveRecord::PostgreSQLAdapter"
abort "ar_suite: the suite connected with #{connection_class}, not #{expected_class}" if connection_class.name != expected_class
warn "ar_suite: connected with #{connection_class}"
require "active_record"
warn "ar_suite: ActiveRecord #{ActiveRecord.version} (#{$LOADED_FEATURES.grep(%r{/active_record\.rb\z}).first})"
