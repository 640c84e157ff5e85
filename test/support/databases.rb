# frozen_string_literal: true

require "erb"

# How the tests reach PostgreSQL, MariaDB, Redis, memcached and RabbitMQ. bin/test starts
# throwaway servers (bin/lib/databases.sh) and exports NEVERBLOCK_PG_*, NEVERBLOCK_MYSQL_*,
# NEVERBLOCK_REDIS_URL, NEVERBLOCK_MEMCACHED_SERVER and NEVERBLOCK_AMQP_URL; these helpers read them. A test that needs a server and finds the variables
# missing fails with a message that says how to start it: database tests never
# skip silently.
#
# Include it in a test class, or call the methods on the module. It loads no
# database gem itself, except pg for {#pg_restart!}.
#
# (Loaded by test_helper after the NeverBlockTest class is defined.)
module NeverBlockTest::Databases
  # Raised when a server is not configured, or does not come back after a restart.
  class Unavailable < StandardError; end

  PG_VARIABLES = {
    host: "NEVERBLOCK_PG_HOST", port: "NEVERBLOCK_PG_PORT", user: "NEVERBLOCK_PG_USER",
    password: "NEVERBLOCK_PG_PASSWORD", dbname: "NEVERBLOCK_PG_DATABASE"
  }.freeze

  MYSQL_VARIABLES = {
    host: "NEVERBLOCK_MYSQL_HOST", port: "NEVERBLOCK_MYSQL_PORT", username: "NEVERBLOCK_MYSQL_USER",
    password: "NEVERBLOCK_MYSQL_PASSWORD", database: "NEVERBLOCK_MYSQL_DATABASE"
  }.freeze

  module_function

  # Keyword arguments for PG.connect.
  # @return [Hash] host:, port: (Integer), user:, password:, dbname:
  # @raise [Unavailable] if NEVERBLOCK_PG_* are not set
  def pg_conninfo
    require_pg!
    read_variables(PG_VARIABLES)
  end

  # The same server as a URL (ActiveRecord, Sequel), user and password escaped.
  # @return [String] postgres://user:password@host:port/dbname
  def pg_url
    info = pg_conninfo
    "postgres://#{ERB::Util.url_encode(info[:user])}:#{ERB::Util.url_encode(info[:password])}" \
      "@#{info[:host]}:#{info[:port]}/#{ERB::Util.url_encode(info[:dbname])}"
  end

  # Options for Mysql2::Client.new, Trilogy.new and ActiveRecord's mysql2/trilogy adapters.
  # @return [Hash] host:, port: (Integer), username:, password:, database:
  # @raise [Unavailable] if NEVERBLOCK_MYSQL_* are not set
  def mysql_config
    require_mysql!
    read_variables(MYSQL_VARIABLES)
  end

  # The Redis server bin/test starts (NEVERBLOCK_REDIS_URL).
  # @return [String] redis://127.0.0.1:PORT/0
  # @raise [Unavailable] if NEVERBLOCK_REDIS_URL is not set
  def redis_url
    require_variables!("Redis", { url: "NEVERBLOCK_REDIS_URL" })
    ENV.fetch("NEVERBLOCK_REDIS_URL")
  end

  # The memcached server bin/test starts (NEVERBLOCK_MEMCACHED_SERVER).
  # @return [String] 127.0.0.1:PORT
  # @raise [Unavailable] if NEVERBLOCK_MEMCACHED_SERVER is not set
  def memcached_server
    require_variables!("memcached", { server: "NEVERBLOCK_MEMCACHED_SERVER" })
    ENV.fetch("NEVERBLOCK_MEMCACHED_SERVER")
  end

  # The RabbitMQ server bin/test starts (NEVERBLOCK_AMQP_URL).
  # @return [String] amqp://guest:guest@127.0.0.1:PORT
  # @raise [Unavailable] if NEVERBLOCK_AMQP_URL is not set
  def amqp_url
    require_variables!("RabbitMQ", { url: "NEVERBLOCK_AMQP_URL" })
    ENV.fetch("NEVERBLOCK_AMQP_URL")
  end

  # @raise [Unavailable] unless every NEVERBLOCK_PG_* variable is set
  def require_pg!
    require_variables!("PostgreSQL", PG_VARIABLES)
  end

  # @raise [Unavailable] unless every NEVERBLOCK_MYSQL_* variable is set
  def require_mysql!
    require_variables!("MariaDB", MYSQL_VARIABLES)
  end

  # Stops PostgreSQL with SIGINT to its postmaster (a fast shutdown: every
  # connection is closed) and waits until the server accepts connections again.
  # Needs the supervisor of bin/lib/databases.sh, which starts the server again
  # when it exits, and a server on this machine (same process namespace).
  #
  # @param conn_or_pid [PG::Connection, Integer] a connection to the server, or
  #   the postmaster's pid
  # @param timeout [Numeric] seconds to wait for the new server (default 30)
  # @return [Integer] the new postmaster's pid
  # @raise [Unavailable] if no new server accepts a connection within `timeout`
  def pg_restart!(conn_or_pid, timeout: 30)
    require "pg"
    old_pid = conn_or_pid.is_a?(Integer) ? conn_or_pid : pg_postmaster_pid(conn_or_pid)
    Process.kill(:INT, old_pid)
    deadline = NeverBlock::Clock.now + timeout
    loop do
      # A connection may still reach the old server before the signal lands:
      # only a different postmaster counts.
      new_pid = new_postmaster_pid
      return new_pid if new_pid && new_pid != old_pid

      if NeverBlock::Clock.now > deadline
        raise Unavailable, "PostgreSQL did not come back within #{timeout} s after SIGINT to its " \
                           "postmaster (pid #{old_pid}); is it supervised by bin/lib/databases.sh?"
      end
      sleep 0.05
    end
  end

  # The postmaster is the parent of every backend process.
  # @param conn [PG::Connection]
  # @return [Integer] the pid of the postmaster that serves `conn`
  def pg_postmaster_pid(conn)
    status = File.read("/proc/#{conn.backend_pid}/status")
    Integer(status[/^PPid:\s*(\d+)/, 1])
  rescue Errno::ENOENT
    raise Unavailable, "no process #{conn.backend_pid}: the PostgreSQL server is not on this machine"
  end

  # @return [Integer, nil] the postmaster's pid, or nil if no connection succeeds now
  def new_postmaster_pid
    conn = PG.connect(**pg_conninfo, connect_timeout: 2)
    pg_postmaster_pid(conn)
  rescue PG::Error
    nil
  ensure
    conn&.close
  end
  private_class_method :new_postmaster_pid

  def require_variables!(server, variables)
    missing = variables.values.reject { |name| ENV[name] && !ENV[name].empty? }
    return if missing.empty?

    raise Unavailable, "#{server} is not running: run the tests with bin/test, which starts it " \
                       "(or set #{missing.join(', ')})"
  end
  private_class_method :require_variables!

  def read_variables(variables)
    variables.to_h do |key, name|
      value = ENV.fetch(name)
      [key, key == :port ? Integer(value) : value]
    end
  end
  private_class_method :read_variables
end
