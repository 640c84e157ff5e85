# frozen_string_literal: true

require "test_helper"
require "socket"
require "tmpdir"
require "neverblock/postgres"

# Opening connections: bounded retries with backoff while the server cannot
# be reached, an immediate NeverBlock::ConnectError when retrying cannot
# help, and new connections after the server restarts.
class PostgresConnectTest < NeverBlockTest
  include NeverBlockTest::PostgresHelpers

  def test_a_server_that_is_down_raises_connect_error_after_bounded_retries
    db = client(port: closed_port)
    error = nil
    time = elapsed { error = assert_raises(NeverBlock::ConnectError) { db.exec("SELECT 1") } }
    # 3 retries after 0.1, 0.2 and 0.4 s (up to 25 % more each).
    assert_match(/4 attempts in \d+\.\d s failed; last error: .*refused/i, error.message)
    assert_operator time, :>=, 0.5
    assert_operator time, :<, 5
    assert_kind_of PG::ConnectionBad, error.cause
    assert_kind_of NeverBlock::Error, error
  end

  def test_every_fiber_waiting_on_a_server_that_is_down_gets_connect_error_and_the_loop_runs_meanwhile
    db = client(port: closed_port, size: 3)
    ticks = 0
    ticker = NeverBlock.spawn { loop { sleep 0.01; ticks += 1 } }
    outcomes = 3.times.map do
      NeverBlock.spawn do
        db.exec("SELECT 1")
      rescue NeverBlock::ConnectError => e
        e
      end
    end.map(&:value)
    ticker.cancel
    ticker.wait
    outcomes.each { |outcome| assert_kind_of NeverBlock::ConnectError, outcome }
    assert_operator ticks, :>=, 10, "the retries held the loop"
    assert_equal({ size: 3, in_use: 0, idle: 0, waiting: 0 }, db.stats)
  end

  def test_fewer_retries_give_up_sooner
    db = client(port: closed_port, connect_retries: 0)
    error = nil
    time = elapsed { error = assert_raises(NeverBlock::ConnectError) { db.exec("SELECT 1") } }
    assert_match(/1 attempts? in/, error.message)
    assert_operator time, :<, 0.5
  end

  def test_a_wrong_password_raises_connect_error_at_once_without_retrying
    db = client(password: "not-the-password", connect_backoff: 2)
    error = nil
    time = elapsed { error = assert_raises(NeverBlock::ConnectError) { db.exec("SELECT 1") } }
    assert_operator time, :<, 1.5, "a retry would have waited 2 s first"
    assert_match(/not retried/, error.message)
    assert_match(/password authentication failed/, error.message)
    assert_includes error.message, "#{pg_conninfo[:user]}@#{pg_conninfo[:host]}:#{pg_conninfo[:port]}"
    refute_includes error.message, "not-the-password"
    assert_kind_of PG::ConnectionBad, error.cause
  end

  # libpq takes what the pool is not given from PGHOST, PGPORT, PGUSER and
  # PGDATABASE: the error names the server it tried, not libpq's defaults.
  def test_the_error_names_the_server_the_pg_environment_variables_chose
    port = closed_port
    with_env("PGHOST" => "127.0.0.1", "PGPORT" => port.to_s, "PGUSER" => "crawler", "PGDATABASE" => "pages") do
      db = client_from(connect_retries: 0)
      error = assert_raises(NeverBlock::ConnectError) { db.exec("SELECT 1") }
      assert_match(%r{\Acannot connect to postgres://crawler@127\.0\.0\.1:#{port}/pages: 1 attempt in}, error.message)
      assert_match(/port #{port} failed/, error.message, "libpq's own error, about the same server")
    end
  end

  # Given parameters win over the environment; a Unix socket is named in
  # the query, as libpq's URIs name it.
  def test_the_error_names_a_unix_socket_and_given_parameters_over_the_environment
    Dir.mktmpdir do |dir|
      with_env("PGHOST" => "127.0.0.1", "PGPORT" => "1") do
        db = client_from(host: dir, port: 6543, user: "app", dbname: "app", connect_retries: 0)
        error = assert_raises(NeverBlock::ConnectError) { db.exec("SELECT 1") }
        assert_match(%r{\Acannot connect to postgres://app@/app\?host=#{Regexp.escape(dir)}&port=6543: }, error.message)
        assert_includes error.message, "#{dir}/.s.PGSQL.6543"
      end
    end
  end

  def test_an_unknown_database_raises_connect_error_at_once_without_retrying
    db = client(dbname: "nb_no_such_database", connect_backoff: 2)
    error = nil
    time = elapsed { error = assert_raises(NeverBlock::ConnectError) { db.exec("SELECT 1") } }
    assert_operator time, :<, 1.5
    assert_match(/not retried.*does not exist/, error.message)
  end

  # A server that accepts and never answers: the connect waits in pg's
  # polling loop when the timeout ends it. The half-open connection is
  # closed at once, not left with its socket to the garbage collector.
  def test_a_connect_a_timeout_interrupts_leaves_no_socket_open
    listener = TCPServer.new("127.0.0.1", 0)
    accepted = []
    acceptor = NeverBlock.spawn { loop { accepted << listener.accept } }
    before = NeverBlock::Testing.open_descriptors
    assert_raises(NeverBlock::TimeoutError) do
      NeverBlock.timeout(0.2) do
        NeverBlock::Postgres::Connection.new(host: "127.0.0.1", port: listener.addr[1], user: "x", dbname: "x",
                                             sslmode: "disable", gssencmode: "disable")
      end
    end
    acceptor.cancel
    acceptor.wait
    accepted.each(&:close)
    listener.close
    after = NeverBlock::Testing.open_descriptors
    opened = after.reject { |fd, target| before[fd] == target }.select { |_, target| target.start_with?("socket:") }
    assert_empty opened, "sockets left open by the interrupted connect"
  ensure
    listener.close unless listener.nil? || listener.closed?
  end

  def test_the_server_restarting_while_the_pool_is_idle
    db = client(size: 2)
    before = open_connections(db, 2)
    restart_server
    after = 2.times.map do
      NeverBlock.spawn { Integer(db.exec("SELECT pg_backend_pid(), pg_sleep(0.05)").getvalue(0, 0)) }
    end.map(&:value)
    assert_empty before & after, "a connection from before the restart was reused"
  end

  def test_a_pipelined_pool_after_the_server_restarted
    db = client(size: 2, pipeline: true)
    open_connections(db, 2)
    restart_server
    values = 20.times.map { |i| NeverBlock.spawn { db.exec_params("SELECT $1::int", [i]).getvalue(0, 0) } }.map(&:value)
    assert_equal (0...20).map(&:to_s), values
  end

  private

  # Restarts PostgreSQL with pg_restart!, which stops it and relies on the
  # supervisor of bin/lib/databases.sh to start it again: a server that
  # nobody would start again (a developer's own) is left alone.
  def restart_server
    admin = PG.connect(**pg_conninfo)
    postmaster = pg_postmaster_pid(admin)
    admin.close
    parent = File.read("/proc/#{postmaster}/status")[/^PPid:\s*(\d+)/, 1]
    unless File.read("/proc/#{parent}/cmdline").include?("nb-db-supervisor")
      flunk "PostgreSQL on port #{pg_conninfo[:port]} is not supervised by bin/test (bin/lib/databases.sh), " \
            "so it would stay down: not restarting it; run this test with bin/test"
    end
    pg_restart!(postmaster)
  end

  # Runs the block with these environment variables set (nil: unset), and
  # puts them back.
  def with_env(variables)
    saved = variables.keys.to_h { |name| [name, ENV.fetch(name, nil)] }
    variables.each { |name, value| ENV[name] = value }
    yield
  ensure
    saved.each { |name, value| ENV[name] = value }
  end

  # A port on 127.0.0.1 that nothing listens on.
  def closed_port
    server = TCPServer.new("127.0.0.1", 0)
    server.addr[1]
  ensure
    server&.close
  end

  # Opens `count` connections at once (each task holds one until all have
  # one); @return [Array<Integer>] their backend pids.
  def open_connections(db, count)
    all_hold_one = Latch.new(count)
    count.times.map do
      NeverBlock.spawn { db.with { |conn| all_hold_one.count_down; all_hold_one.wait; conn.backend_pid } }
    end.map(&:value)
  end
end

# NeverBlock::Connector, the retry loop behind Postgres.pool, with a fake
# driver: which errors it retries, how long it waits, what it raises.
class ConnectorTest < PlainTest
  class FakeConnectionError < StandardError; end

  def test_a_retryable_error_is_retried_with_doubling_backoff_then_raised
    attempts = 0
    connector = connector(retries: 3, backoff: 0.1) do
      attempts += 1
      raise FakeConnectionError, "connection refused\nsecond line"
    end
    error = assert_raises(NeverBlock::ConnectError) { connector.call }
    assert_equal 4, attempts
    assert_backoff [0.1, 0.2, 0.4], @slept
    assert_match(/\Acannot connect to db:5432: 4 attempts in \d+\.\d s failed; last error: connection refused\z/,
                 error.message)
    assert_kind_of FakeConnectionError, error.cause
  end

  def test_the_backoff_is_capped_at_two_seconds
    connector = connector(retries: 4, backoff: 0.75) { raise FakeConnectionError, "refused" }
    assert_raises(NeverBlock::ConnectError) { connector.call }
    assert_backoff [0.75, 1.5, 2.0, 2.0], @slept
  end

  def test_a_connection_after_failed_attempts_is_returned
    attempts = 0
    connector = connector(retries: 3) do
      attempts += 1
      raise FakeConnectionError, "refused" if attempts < 3

      :connection
    end
    assert_equal :connection, connector.call
    assert_equal 2, @slept.size
  end

  def test_a_final_error_is_raised_at_once
    attempts = 0
    connector = connector(retryable: ->(_) { false }) do
      attempts += 1
      raise FakeConnectionError, "password authentication failed"
    end
    error = assert_raises(NeverBlock::ConnectError) { connector.call }
    assert_equal 1, attempts
    assert_empty @slept
    assert_equal "cannot connect to db:5432 (not retried): password authentication failed", error.message
  end

  def test_errors_that_are_not_connection_errors_propagate_untouched
    connector = connector { raise ArgumentError, "bad option" }
    assert_raises(ArgumentError) { connector.call }
    assert_empty @slept
  end

  def test_bad_arguments
    assert_raises(ArgumentError) { NeverBlock::Connector.new("db", errors: [], retryable: nil) }
    assert_raises(ArgumentError) { NeverBlock::Connector.new("db", errors: [], retryable: nil, retries: -1) { 1 } }
    assert_raises(ArgumentError) { NeverBlock::Connector.new("db", errors: [], retryable: nil, retries: 1.5) { 1 } }
    assert_raises(ArgumentError) { NeverBlock::Connector.new("db", errors: [], retryable: nil, backoff: -1) { 1 } }
  end

  def test_postgres_sorts_its_connection_errors_into_retryable_and_final
    retryable = ["connection to server at \"127.0.0.1\", port 1 failed: Connection refused",
                 "FATAL:  the database system is starting up",
                 "FATAL:  sorry, too many clients already",
                 "connection to server at \"127.0.0.1\", port 5432 failed: could not send startup packet: " \
                 "Connection reset by peer",
                 "could not receive data from server: Connection reset by peer"]
    final = ["FATAL:  password authentication failed for user \"nb\"",
             "FATAL:  database \"x\" does not exist",
             "FATAL:  no pg_hba.conf entry for host \"10.0.0.1\""]
    retryable.each { |message| assert NeverBlock::Postgres.retryable?(PG::ConnectionBad.new(message)), message }
    final.each { |message| refute NeverBlock::Postgres.retryable?(PG::ConnectionBad.new(message)), message }
  end

  # A real listener that resets every connection, as a server in start-up
  # or shutdown can: retried, then reported with the attempts.
  def test_postgres_retries_a_server_that_resets_connections
    listener = TCPServer.new("127.0.0.1", 0)
    resetter = Thread.new do
      loop do
        client = listener.accept
        client.setsockopt(Socket::SOL_SOCKET, Socket::SO_LINGER, [1, 0].pack("ii")) # close sends RST
        client.close
      end
    rescue IOError
      nil
    end
    connector = NeverBlock::Postgres.connector(host: "127.0.0.1", port: listener.addr[1], user: "nb", dbname: "nb",
                                               retries: 2, backoff: 0.01)
    error = assert_raises(NeverBlock::ConnectError) { connector.call }
    assert_match(/3 attempts in .* failed/, error.message)
    refute_match(/not retried/, error.message)
  ensure
    listener&.close
    resetter&.join(2)
  end

  private

  # A Connector for "db:5432" whose waits are recorded in @slept instead of slept.
  def connector(retries: 3, backoff: 0.1, retryable: ->(_) { true }, &open)
    @slept = []
    slept = @slept
    NeverBlock::Connector.new("db:5432", errors: [FakeConnectionError], retryable: retryable,
                                         retries: retries, backoff: backoff, &open).tap do |connector|
      connector.define_singleton_method(:sleep) { |seconds| slept << seconds }
    end
  end

  # Each wait is its base (doubling from the first) plus up to 25 % jitter.
  def assert_backoff(bases, slept)
    assert_equal bases.size, slept.size, "waits: #{slept.inspect}"
    bases.zip(slept).each do |base, seconds|
      assert_operator seconds, :>=, base
      assert_operator seconds, :<=, base * 1.25
    end
  end
end
