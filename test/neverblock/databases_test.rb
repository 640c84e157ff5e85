# frozen_string_literal: true

require "test_helper"
require "pg"
require "mysql2"
require "uri"

# The servers bin/test starts (bin/lib/databases.sh), as the database tests
# rely on them: reachable over TCP with a password, and PostgreSQL back after
# a restart. Outside the event loop: these check the harness, not NeverBlock.
class DatabasesTest < PlainTest
  include NeverBlockTest::Databases

  def test_postgresql_15_answers
    with_pg { |conn| assert_includes conn.exec("SELECT version()").getvalue(0, 0), "PostgreSQL 15" }
  end

  def test_postgresql_refuses_a_wrong_password_over_tcp
    error = assert_raises(PG::ConnectionBad) { PG.connect(**pg_conninfo, password: "wrong") }
    assert_match(/password authentication failed/, error.message)
  end

  def test_postgresql_accepts_the_url
    conn = PG.connect(pg_url)
    assert_equal pg_conninfo[:dbname], conn.db
  ensure
    conn&.close
  end

  def test_mariadb_answers
    with_mysql { |client| assert_includes client.query("SELECT version()").first.values.first, "MariaDB" }
  end

  def test_the_mariadb_user_may_kill_another_connection
    with_mysql do |victim|
      with_mysql { |killer| killer.query("KILL #{victim.thread_id}") }
      assert_raises(Mysql2::Error) { victim.query("SELECT 1") }
    end
  end

  def test_redis_answers
    uri = URI(redis_url)
    socket = TCPSocket.new(uri.host, uri.port)
    socket.write("*1\r\n$4\r\nPING\r\n")
    assert_equal "+PONG\r\n", socket.gets
  ensure
    socket&.close
  end

  def test_pg_restart_starts_a_new_postmaster_and_old_connections_break
    with_pg do |conn|
      old_pid = pg_postmaster_pid(conn)
      new_pid = pg_restart!(conn)
      refute_equal old_pid, new_pid
      assert_raises(PG::Error) { conn.exec("SELECT 1") }
      with_pg { |fresh| assert_equal new_pid, pg_postmaster_pid(fresh) }
    end
  end

  def test_a_missing_variable_is_an_error_that_says_how_to_start_the_server
    saved = ENV.delete("NEVERBLOCK_PG_PORT")
    error = assert_raises(NeverBlockTest::Databases::Unavailable) { pg_conninfo }
    assert_equal "PostgreSQL is not running: run the tests with bin/test, which starts it " \
                 "(or set NEVERBLOCK_PG_PORT)", error.message
  ensure
    ENV["NEVERBLOCK_PG_PORT"] = saved
  end

  private

  def with_pg
    conn = PG.connect(**pg_conninfo)
    yield conn
  ensure
    conn&.close
  end

  def with_mysql
    client = Mysql2::Client.new(**mysql_config)
    yield client
  ensure
    client&.close
  end
end
