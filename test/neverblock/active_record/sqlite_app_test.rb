# frozen_string_literal: true

require "test_helper"
require "net/http"
require "tmpdir"
require "fileutils"
require "neverblock/active_record"
require_relative "../../support/serve_processes"

# A Rails app on SQLite, as `rails new` makes it, served by `neverblock
# serve`: twenty requests at once that each write in a transaction lasting
# 0.3 s. SQLite takes one writer at a time and the others poll in its busy
# handler for at most 5 s, unfairly: the requests that came last took the
# lock first and the first ones failed with SQLite3::BusyException. With
# NeverBlock's transactions taking turns (ActiveRecord::SqliteWriteTurns),
# all twenty are served. (A pool of 25, as `neverblock serve` sets
# RAILS_MAX_THREADS when it is unset: with 5, the last writers would wait
# for a connection instead.)
class ActiveRecordSqliteAppTest < PlainTest
  include ServeProcesses

  APP = File.expand_path("../../fixtures/rails_sqlite/config.ru", __dir__)
  WRITERS = 20

  def setup
    @dir = Dir.mktmpdir("nb-sqlite")
  end

  def teardown
    super
  ensure
    FileUtils.rm_rf(@dir) if @dir
  end

  def test_twenty_writers_at_once_are_all_served
    start
    statuses = write_at_once
    assert_equal ["200"] * WRITERS, statuses, output
    assert_equal WRITERS, Integer(get(@server, "/count").body)
  end

  # What the turns prevent, so that the test above can fail: racing for
  # the lock in SQLite's busy handler, some writers wait past its 5 s and
  # fail.
  # (ActiveRecord 8: 7.2 gives `timeout:` to SQLite's own busy timeout,
  # which waits in C holding the whole process, so that without turns the
  # twenty writers take minutes rather than failing at 5 s.)
  def test_without_turns_some_writers_fail_with_database_is_locked
    require "active_record"
    skip "ActiveRecord #{::ActiveRecord::VERSION::STRING}: SQLite's busy timeout waits in C, holding the process" if ::ActiveRecord::VERSION::MAJOR < 8
    start(NeverBlock::ActiveRecord::SqliteWriteTurns::SWITCH => "off")
    statuses = write_at_once
    assert_operator statuses.count("500"), :>=, 1, "every writer was served with all twenty in SQLite at once"
    # The 500s' backtraces reach the output in their own time (read by a thread).
    eventually { output.match?(/SQLite3::BusyException/) }
  end

  private

  def start(env = {})
    @server = serve(APP, "-w", "0", "-E", "production", "--no-adaptive-limit", timeout: 60,
                    env: { "NB_SQLITE_DATABASE" => File.join(@dir, "production.sqlite3"),
                           "RAILS_MAX_THREADS" => "25" }.merge(env))
    # The server's output goes on being read (three 500s' backtraces could
    # fill the pipe and block it); ServeProcesses#teardown closes it.
    Thread.new do
      @server[:out].each_line { |line| @server[:lines] << line }
    rescue IOError
      nil
    end
  end

  def output
    sleep 0.2 # the last lines
    @server[:lines].join
  end

  # Twenty GET /write sent together; their statuses.
  def write_at_once
    gate = Queue.new
    threads = Array.new(WRITERS) do
      Thread.new do
        Net::HTTP.start("127.0.0.1", @server[:port], read_timeout: 60) do |http|
          gate.pop
          http.get("/write").code
        end
      end
    end
    sleep 0.2 until gate.num_waiting == WRITERS
    WRITERS.times { gate << true }
    threads.map(&:value)
  end
end
