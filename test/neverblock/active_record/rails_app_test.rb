# frozen_string_literal: true

require "test_helper"
require "json"
require "net/http"
require "open3"
require "timeout"

# A Rails app with ActiveRecord on PostgreSQL, served by `neverblock serve`
# as a user would: the gem in the Gemfile and nothing else, the stock
# `postgresql` adapter, Rails' generated pool of 5.
class ActiveRecordRailsAppTest < PlainTest
  include NeverBlockTest::Databases

  EXE = File.expand_path("../../../exe/neverblock", __dir__)
  APP = File.expand_path("../../fixtures/rails_pg/config.ru", __dir__)

  def setup
    info = pg_conninfo
    @env = { "NEVERBLOCK_PG_HOST" => info[:host], "NEVERBLOCK_PG_PORT" => info[:port].to_s,
             "NEVERBLOCK_PG_USER" => info[:user], "NEVERBLOCK_PG_PASSWORD" => info[:password].to_s,
             "NEVERBLOCK_PG_DATABASE" => info[:dbname] }
  end

  def teardown
    if @pid
      Process.kill("TERM", @pid)
      Timeout.timeout(30) { Process.wait(@pid) }
    end
  rescue Errno::ESRCH, Errno::ECHILD
    nil
  ensure
    @reader&.close
    super
  end

  def start(env = {}, *options)
    @reader, writer = IO.pipe
    @pid = Process.spawn(@env.merge(env), RbConfig.ruby, EXE, "serve", APP, "-b", "tcp://127.0.0.1:0", "-w", "0",
                         "-E", "production", *options, out: writer, err: writer)
    writer.close
    @lines = []
    line = read_until(/serving .* on tcp:/)
    @port = Integer(line[%r{tcp://127\.0\.0\.1:(\d+)}, 1])
  end

  def read_until(pattern, timeout: 60)
    Timeout.timeout(timeout) do
      loop do
        found = @lines.find { |l| l.match?(pattern) }
        return found if found

        line = @reader.gets or raise "the server exited:\n#{@lines.join}"
        @lines << line
      end
    end
  end

  # The backend pids of a Live stream's three events.
  def live_pids(path)
    response = get(path)
    assert_equal "200", response.code, response.body
    pids = response.body.scan(/^data: (\d+)$/).flatten
    assert_equal 3, pids.size, response.body
    pids
  end

  def get(path)
    Net::HTTP.start("127.0.0.1", @port, read_timeout: 30) { |http| http.get(path) }
  end

  # Twenty concurrent requests, each 500 ms in the database on its own
  # leased connection: every one answered (the pool of 5 hands connections
  # on), at the fiber isolation level, five backends, in about 2 s.
  def test_concurrent_requests_on_the_stock_postgresql_adapter_each_get_their_own_connection
    start("RAILS_MAX_THREADS" => "5") # as a shell with Puma's setting would have it
    responses = nil
    took = elapsed do
      responses = Array.new(20) { Thread.new { get("/sleep") } }.map(&:value)
    end
    assert_equal ["200"], responses.map(&:code).uniq, responses.map(&:body).uniq.first(3).inspect
    pids, levels = responses.map { |r| r.body.split }.transpose
    assert_equal ["fiber"], levels.uniq
    assert_operator pids.uniq.size, :<=, 5
    assert_operator took, :<, 8, "20 x 0.5 s over a pool of 5 took #{took.round(2)} s"
  end

  # A Live action runs as a task of its request: the connection it leases
  # goes back to the pool as it ends, so streams one after another share
  # one, and none is left checked out under a fiber that has ended. Also
  # when the request's own fiber leased one first (a middleware): Rails
  # copies the request fiber's locals into the action's fiber and clears
  # them at its end.
  def test_live_streams_one_after_another_share_the_connection_their_actions_lease
    start
    pids = Array.new(5) { live_pids("/live_pids") }
    assert_equal 1, pids.flatten.uniq.size, "each stream leased a connection of its own: #{pids.inspect}"
    # Each of these leases two at once: the request's, then the action's.
    pids = Array.new(5) { live_pids("/live_pids_after_lease") }
    assert_operator pids.flatten.uniq.size, :<=, 2, "each stream leased a connection of its own: #{pids.inspect}"
    stat = JSON.parse(get("/pool").body)
    assert_equal 0, stat["busy"] + stat.fetch("dead", 0), stat.inspect
  end

  # With RAILS_MAX_THREADS unset, neverblock serve sets it to 25: the
  # generated database.yml's pool then serves the twenty at once.
  def test_the_generated_pool_gets_25_connections_under_neverblock_serve
    start("RAILS_MAX_THREADS" => nil)
    responses = Array.new(20) { Thread.new { get("/sleep") } }.map(&:value)
    assert_equal ["200"], responses.map(&:code).uniq
    assert_operator responses.map { |r| r.body.split.first }.uniq.size, :>, 5, "more backends than a pool of 5"
    assert(@lines.any? { |line| line.include?("RAILS_MAX_THREADS was not set: set to 25") }, @lines.join)
  end

  # Rails' "Completed ... (ActiveRecord: X ms)" is per request: a fast
  # request served while slow ones wait in the database reports its own
  # time, not theirs added up.
  #
  # The slow ones (/held) wait on an advisory lock the test holds, not for a
  # fixed time: the fast one is sent once all three sit in the database, and
  # answers while they still do, however slow the machine (were the requests
  # to share a connection, it could not). They are released once they have
  # waited ten times what the fast one logged (a second at least), so that an
  # order of magnitude separates its own time from one charged theirs.
  def test_each_request_logs_its_own_active_record_time
    require "pg"
    start("NB_TEST_ADAPTER" => "neverblock_postgresql")
    # The pool's five connections open first: a new connection's setup
    # queries are charged to the request that opens it, but run before
    # Rails starts timing the action.
    Array.new(5) { Thread.new { get("/sleep") } }.each { |thread| assert_equal "200", thread.value.code }
    5.times { take_line(/Completed 200/) }
    database = PG.connect(**pg_conninfo)
    database.exec("SELECT pg_advisory_lock(#{HELD_LOCK})")
    slow = Array.new(3) { Thread.new { get("/held") } }
    eventually { held_requests(database) == 3 } # the slow ones are in the database
    in_database = now
    fast = get("/fast")
    assert_equal "200", fast.code, -> { "#{fast.body}\n#{@lines.join}#{@reader.read_nonblock(65_536, exception: false)}" }
    fast_line = take_line(/Completed 200/) # the slow ones cannot complete yet
    assert_equal 3, held_requests(database), "the fast request answered while the slow ones waited"
    fast_total, fast_active_record = logged_times(fast_line)
    sleep 0.01 until now - in_database >= [(10 * (fast_total + fast_active_record) / 1000.0) + 0.1, 1].max
    database.exec("SELECT pg_advisory_unlock(#{HELD_LOCK})")
    slow.each { |thread| assert_equal "200", thread.value.code }
    completed = [fast_line, *Array.new(3) { take_line(/Completed 200/) }]
    times = completed.map { |line| logged_times(line) }
    slow_times = times.drop(1)
    # Charged the others' time, it would show at least one slow request's,
    # ten times its own; its own select takes about a millisecond, more on
    # a loaded machine (105.8 ms seen at load 10).
    slow_times.each do |total, active_record|
      assert_operator fast_total * 10, :<=, total, completed.join
      assert_operator fast_active_record * 10, :<=, active_record,
                      "the fast request was charged other requests' database time:\n#{completed.join}"
    end
    times.each { |total, active_record| assert_operator active_record, :<=, total + 2, completed.join }
  ensure
    database&.close # releases the lock, if a failure left it held
  end

  HELD_LOCK = 7_316_001 # test/fixtures/rails_pg/config.ru's ProbeController::HELD_LOCK

  # How many /held requests wait in the database on HELD_LOCK.
  def held_requests(database)
    database.exec("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%nb_held%' AND state = 'active' " \
                  "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()").getvalue(0, 0).to_i
  end

  # The first line that matches `pattern` (see #read_until), taken off @lines.
  def take_line(pattern)
    line = read_until(pattern)
    @lines.delete_at(@lines.index(line))
  end

  # [total ms, ActiveRecord ms] from a "Completed 200 OK in 12ms (... ActiveRecord: 1.2ms ...)" line.
  def logged_times(line)
    [Integer(line[/in (\d+)ms/, 1]), Float(line[/ActiveRecord: ([\d.]+)ms/, 1])]
  end

  # --request-timeout 1 on an action that inserted a row in a transaction
  # and then waits 60 s in pg_sleep: a 503 in about a second (within 20 s
  # on a loaded machine, well before the query's end), the query cancelled
  # on the server, the row rolled back, and the pool's one connection
  # (RAILS_MAX_THREADS=1) answers the next request.
  [%w[stock postgresql], %w[neverblock neverblock_postgresql]].each do |name, adapter|
    define_method(:"test_request_timeout_cancels_the_query_and_rolls_back_on_the_#{name}_adapter") do
      require "pg"
      database = PG.connect(**pg_conninfo)
      database.exec("SET client_min_messages TO warning") # no NOTICE for DROP TABLE IF EXISTS
      database.exec("DROP TABLE IF EXISTS nb_rt_rows")
      database.exec("CREATE TABLE nb_rt_rows (id serial PRIMARY KEY, note text)")
      start({ "RAILS_MAX_THREADS" => "1", "NB_TEST_ADAPTER" => adapter }, "--request-timeout", "1")
      response = nil
      took = elapsed { response = get("/doomed") }
      assert_equal "503", response.code, response.body
      assert_equal "1", response["retry-after"]
      assert_operator took, :<, 20, "the 503 took #{took.round(2)} s"
      backend = Integer(read_until(/doomed on backend \d+/)[/backend (\d+)/, 1])
      read_until(%r{GET /doomed timed out after [\d.]+ s \(request_timeout 1\.0 s, pid #{@pid}\)})
      deadline = now + 30
      until (running = database.exec("SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%nb_rt_doomed%' " \
                                      "AND state = 'active' AND pid <> pg_backend_pid()").getvalue(0, 0).to_i).zero?
        break if now > deadline

        sleep 0.02
      end
      assert_equal 0, running, "pg_sleep(60) still runs on the server"
      assert_equal "0", database.exec("SELECT count(*) FROM nb_rt_rows").getvalue(0, 0), "the insert was not rolled back"
      after = get("/pid")
      assert_equal "200", after.code, after.body
      assert_equal backend, Integer(after.body), "the pool's one connection should be the same, healthy"
    ensure
      database&.exec("DROP TABLE IF EXISTS nb_rt_rows")
      database&.close
    end
  end
end
