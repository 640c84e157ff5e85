# frozen_string_literal: true

require "test_helper"
require "neverblock/active_record"

# load_async on NeverBlock's fibers (NeverBlock::ActiveRecord::AsyncQueries),
# against the PostgreSQL that bin/test starts: relations loaded at once run
# concurrently without threads, and go with the task that started them.
class ActiveRecordLoadAsyncTest < NeverBlockTest
  include NeverBlockTest::Databases

  class Record < ActiveRecord::Base
    self.abstract_class = true
  end

  class Row < Record
    self.table_name = "nb_async_rows"
  end

  def setup
    @executor = ActiveRecord.async_query_executor
    ActiveRecord.async_query_executor = :global_thread_pool
    info = pg_conninfo
    Record.establish_connection(adapter: "neverblock_postgresql", host: info[:host], port: info[:port],
                                username: info[:user], password: info[:password], database: info[:dbname],
                                pool: 10, checkout_timeout: 5)
    Record.connection_pool.with_connection do |connection|
      connection.execute("DROP TABLE IF EXISTS nb_async_rows")
      connection.execute("CREATE TABLE nb_async_rows (id serial PRIMARY KEY)")
      connection.execute("INSERT INTO nb_async_rows DEFAULT VALUES")
    end
    @marker = "nb_async_#{rand(1 << 30)}"
    @session = ActiveRecord::Base.asynchronous_queries_tracker.start_session # what Rails' executor does per request
  end

  def teardown
    tracker = ActiveRecord::Base.asynchronous_queries_tracker
    tracker.method(:finalize_session).arity.zero? ? tracker.finalize_session : tracker.finalize_session(true) # 7.2: no argument
    Record.connection_pool.with_connection { |connection| connection.execute("DROP TABLE IF EXISTS nb_async_rows") }
    Record.connection_pool.disconnect!
    Record.remove_connection
  ensure
    ActiveRecord.async_query_executor = @executor
  end

  # A relation whose query sleeps `seconds` on the server, marked for pg_stat_activity.
  def sleeping(seconds)
    Row.where("pg_sleep(#{seconds}) IS NOT NULL AND '#{@marker}' <> ''")
  end

  def test_four_relations_loaded_async_take_the_time_of_one
    relations = nil
    seconds = elapsed do
      relations = Array.new(4) { sleeping(1).load_async }
      assert_equal [1, 1, 1, 1], relations.map { |relation| relation.to_a.size }
    end
    assert_operator seconds, :<, 2.5, "4 one-second queries took #{seconds.round(2)} s: not concurrent"
    assert relations.all?(&:scheduled?) || relations.all?(&:loaded?)
  end

  def test_an_async_query_is_cancelled_with_the_task_that_started_it
    info = pg_conninfo
    observer = PG.connect(**info)
    running = lambda do
      observer.exec_params("SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1 " \
                           "AND pid <> pg_backend_pid()", ["%#{@marker}%"]).getvalue(0, 0).to_i
    end
    request = NeverBlock.spawn do
      tracker = ActiveRecord::Base.asynchronous_queries_tracker
      tracker.start_session # a request's, as Rails' executor starts it (per fiber on Rails 8)
      sleeping(10).load_async
      sleep 10 # the request does other work meanwhile
    end
    assert NeverBlock.defer { poll(5) { running.call == 1 } }, "the async query never ran"
    request.cancel.wait
    gone = elapsed { NeverBlock.defer { poll(5) { running.call.zero? } } }
    assert_operator gone, :<, 2, "the async query still ran #{gone.round(2)} s after its task was cancelled"
    assert_equal 0, Record.connection_pool.stat[:busy]
  ensure
    observer&.close
  end

  def test_outside_neverblock_activerecord_keeps_its_threads
    rows = Thread.new do
      ActiveRecord::Base.asynchronous_queries_tracker.start_session
      sleeping(0).load_async.to_a
    end.value
    assert_equal 1, rows.size
  end

  private

  # Polls the block every 20 ms for at most `seconds` (in a thread: the
  # observer's connection blocks); true once it held.
  def poll(seconds)
    deadline = now + seconds
    sleep 0.02 until (held = yield) || now > deadline
    held
  end
end
