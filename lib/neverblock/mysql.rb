# frozen_string_literal: true

# What blocks in the MySQL drivers under a Fiber scheduler, and what
# NeverBlock::MySQL does about it. Read from the C sources of trilogy 2.13.3
# and mysql2 0.5.7 (vendor/bundle/ruby/3.1.0/gems/*/ext) and measured against
# MariaDB 10.11 on Ruby 3.1.2 and 3.3.8, epoll selector, 2 vCPUs. "Held the
# loop" is the longest gap seen meanwhile by a fiber that sleeps 1 ms in a
# loop.
#
# trilogy: every wait suspends only the fiber.
# - Trilogy.new opens its socket with Ruby's TCPSocket.new (UNIXSocket.new
#   for socket:), so DNS goes to the scheduler's address_resolve hook (the
#   thread pool) and connect(2) waits in io_wait; the handshake and every
#   later reply wait in trilogy's C callback _cb_ruby_wait ->
#   rb_wait_for_single_fd, which calls the scheduler's io_wait. Sockets are
#   non-blocking, so a spurious wakeup is harmless.
#   Measured: 10 concurrent `SELECT SLEEP(1)` take 1.00 s, and a fiber
#   ticking every 10 ms ticks 98-100 times meanwhile; a connect to a
#   server that accepts and never answers waits its connect_timeout with
#   the loop free; a 200,000-row (20 MB) result held the loop 15 ms (3.1)
#   to 40 ms (3.3) at a time, parsing between reads.
# - An exception raised at one of those waits (NeverBlock.timeout,
#   Timeout.timeout, Task#cancel) makes trilogy close its socket (rb_protect
#   in _cb_ruby_wait -> trilogy_sock_shutdown), and MariaDB runs the query
#   on regardless: it stops a statement that is killed, not one whose
#   client left (a SLEEP(3) stayed in information_schema.PROCESSLIST after
#   the client closed). What NeverBlock does: it sends `KILL QUERY <id>`
#   from a second, short-lived session, closes the dead connection and the
#   pool opens a new one when needed. Trilogy has no accessor for the
#   session id, so CONNECTION_ID() is read once, when the connection opens.
# - Trilogy.new on the loop is not safe, though nothing in it blocks: it
#   waits for connect(2) on a Ruby socket (registered with the loop's
#   epoll), dup()s the descriptor and closes the Ruby socket. When the
#   handshake completes without another wait (seen with strace on Ruby 3.3,
#   on the first connection of a test process), the close comes before
#   io-event's deferred EPOLL_CTL_DEL, and the kernel keeps the
#   registration, since the dup holds the socket open. The loop then spins
#   (epoll reports EPOLLOUT for the closed number at every turn; a
#   TCPSocket.new, dup, close, then a 1 s sleep cost 1 s of CPU), and the
#   connection's traffic wakes whatever fiber waits on a new descriptor
#   with that number: in the tests, a mysql2 socket, whose blocking read
#   then held the loop for 30 s. What NeverBlock does: it opens trilogy
#   connections on the thread pool (NeverBlock.defer), where no scheduler
#   registers anything; queries run on the loop. (Any code that dup()s a
#   socket it waited on and closes the original can cause this.)
#
# mysql2: libmariadb runs with the GVL released (rb_thread_call_without_gvl),
# so those calls block the thread, and with it the loop.
# - Connecting (mysql_real_connect, DNS included) blocks for the whole
#   handshake: a connect to a server that never answers held the loop for
#   its full connect_timeout. What NeverBlock does: it connects on the
#   thread pool (NeverBlock.defer); a connection that finishes after its
#   caller gave up (a timeout, a cancellation) is closed at once. mysql2
#   takes whole seconds, so fractional timeouts are rounded up. And
#   automatic_close defaults to false: the pool closes its connections
#   itself, and a client garbage-collected in a forked child must not send
#   QUIT on the parent's session (with true, the parent's idle connection
#   died when a child exited).
# - Client#query sends the statement (mysql_send_query: blocks only if the
#   SQL outgrows the socket buffer), waits for the reply through
#   rb_wait_for_single_fd, so the scheduler (10 x SLEEP(1): 1.00 s, ticker
#   98 ticks), then reads the whole reply blocking (mysql_read_query_result,
#   mysql_store_result): a 200,000-row (20 MB) result held the loop 118-141
#   ms. And as with trilogy, an interrupt during the wait makes mysql2 throw
#   its socket away (disconnect_and_raise -> invalidate_fd).
#   What NeverBlock does: it sends with `async: true`, waits on the socket
#   itself, then calls async_result. An interrupt during that wait leaves
#   the session intact: NeverBlock sends `KILL QUERY <thread_id>` from a
#   second session, reads and drops the interrupted reply (error 1317 "Query
#   execution was interrupted", or the result if it finished first), rolls
#   back an open transaction, and the same connection goes back to the pool.
#   Before the blocking read it checks with a non-blocking MSG_PEEK that
#   data has really arrived (a stale readiness report, as above, would
#   otherwise hold the loop until the reply came). The reply is read on the
#   loop: reading it on the thread pool spares the loop only for large
#   results and costs about 30 us per query (SELECT 1: 26 -> 55-70 us).
# - mysql2 also blocks, for code using the raw connection from Client#with:
#   prepared statements (prepare/execute: 3 concurrent `SELECT SLEEP(?)`
#   with 0.5 took 1.5 s), the rows of a `stream: true` result, the further
#   results of a multi-statement query (abandon_results!, next_result),
#   ping, select_db. Wrap them in NeverBlock.defer, or use Client#query.
# - mysql2 defers Timeout::Error during its own Client#query
#   (Thread.handle_interrupt), so on a plain thread Timeout.timeout cannot
#   interrupt it; NeverBlock's wait can be interrupted, there too.
#
# Both drivers: every interrupted statement is killed, since closing the
# connection does not stop it; so is one that outlives the driver's own
# read_timeout (the driver's timeout error is raised). A `KILL QUERY` that arrives after the
# statement finished does nothing (MariaDB 10.11 does not carry it over to
# the next statement). Measured: NeverBlock.timeout(0.2) around
# `SELECT SLEEP(30)` raises after 0.20-0.21 s, the kill included, and the
# statement is gone from the process list. The pool costs about 7 us per
# Client#query (SELECT 1 over TCP on 127.0.0.1: trilogy 19 -> 26 us,
# mysql2 23 -> 33 us). Without a loop (plain threads) the same code blocks
# the calling thread, as the drivers always did.

require_relative "../neverblock"
require_relative "connection_pool"
require_relative "connector"
require_relative "isolation"
require_relative "mysql/connection"
require_relative "mysql/recovery"
require_relative "mysql/client"

require "uri"

module NeverBlock
  # MySQL and MariaDB through the trilogy gem or the mysql2 gem,
  # concurrently: a pool-backed {MySQL::Client} whose queries suspend only
  # the calling fiber inside NeverBlock and block the thread elsewhere.
  #
  #   require "neverblock/mysql"
  #
  #   DB = NeverBlock::MySQL.pool(driver: :trilogy, size: 12, host: "127.0.0.1",
  #                               username: "app", password: "secret", database: "app")
  #   NeverBlock.run do
  #     10.times.map { NeverBlock.spawn { DB.query("SELECT SLEEP(1)") } }.each(&:value) # ~1 s
  #   end
  #
  # What it adds to the drivers:
  # - a {ConnectionPool} (FIFO waiters, checkout timeout, broken connections
  #   replaced, fresh connections in forked children);
  # - server-side cancel: a query interrupted by {NeverBlock.timeout},
  #   `Timeout.timeout` or {Task#cancel} is stopped on the server with
  #   `KILL QUERY`, and its connection restored (mysql2) or replaced
  #   (trilogy, which closes its socket when interrupted);
  # - connections opened on NeverBlock's thread pool (mysql2's connect
  #   blocks the loop, trilogy's can leave a stale epoll registration: see
  #   the notes at the top of this file);
  # - connecting with bounded retries ({ConnectError} when the server stays
  #   down; at once for a wrong password or an unknown database).
  #
  # Only the gem of the driver chosen is loaded, when a pool is made.
  module MySQL
    # The drivers: name => [gem, file that defines the Connection class, class name].
    DRIVERS = {
      trilogy: ["trilogy", "mysql/trilogy_connection", :TrilogyConnection],
      mysql2: ["mysql2", "mysql/mysql2_connection", :Mysql2Connection]
    }.freeze

    # Seconds to connect (TCP plus handshake) unless `connect_timeout:` says.
    DEFAULT_CONNECT_TIMEOUT = 5

    # Error numbers after which connecting again cannot help: access denied
    # (1044, 1045, 1698), unknown database (1049), host not allowed or
    # blocked (1129, 1130), authentication method refused (1251, 2059).
    FINAL = [1044, 1045, 1049, 1129, 1130, 1251, 1698, 2059].freeze

    # Failures worth another attempt: the server is down, starting,
    # stopping or full, or the network failed.
    RETRYABLE = Regexp.union(
      /can't connect/i, /connection refused/i, /no such file or directory/i, /lost connection/i,
      /server has gone away/i, /timed? ?out/i, /too many connections/i, /shutdown in progress/i,
      /TRILOGY_CLOSED_CONNECTION/, /connection reset/i, /network is unreachable/i, /no route to host/i,
      /broken pipe/i, /unable to connect/i
    )

    # Connection options of {.pool} that are aliases: alias => the drivers' name.
    ALIASES = { user: :username, pass: :password, dbname: :database, db: :database, hostname: :host,
                sock: :socket }.freeze

    class << self
      # A pool-backed client.
      #
      # @param driver [Symbol] :trilogy (default) or :mysql2; its gem must
      #   be installed.
      # @param size [Integer] connections at most (default 12).
      # @param timeout [Numeric] seconds a caller waits for a free connection
      #   before {PoolTimeout} (default 5).
      # @param connect_retries [Integer] attempts after the first when the
      #   server cannot be reached (default 3; backoff 0.1, 0.2, 0.4 s...).
      # @param connect_backoff [Numeric] seconds before the first retry.
      # @param url [String, nil] `mysql://user:password@host:port/database`
      #   (also mysql2://, trilogy://, mariadb://; query parameters become
      #   options); keywords override it.
      # @param config [Hash] host:, port:, username:, password:, database:,
      #   socket:, connect_timeout: (seconds, default 5), and any other
      #   option of Trilogy.new or Mysql2::Client.new.
      # @param opentelemetry [Boolean] a client span per statement (see
      #   {NeverBlock::Telemetry.query_span}); needs OpenTelemetry's API
      #   loaded. Off by default (opentelemetry-instrumentation-mysql2 or -trilogy makes its own).
      # @return [Client]
      # @raise [ArgumentError] for an unknown driver, a bad size or timeout,
      #   or opentelemetry without OpenTelemetry.
      # @raise [LoadError] when the driver's gem is missing.
      def pool(driver: :trilogy, size: 12, timeout: 5, connect_retries: 3, connect_backoff: 0.1, url: nil,
               opentelemetry: false, **config)
        connection_class = connection_class(driver)
        config = configuration(url, config)
        connector = connector(connection_class, config, retries: connect_retries, backoff: connect_backoff)
        Client.new(connection_class, config, connector, size: size, timeout: timeout, opentelemetry: opentelemetry)
      end

      # @param error [Exception] a driver error raised while connecting.
      # @return [Boolean] whether connecting again may succeed.
      def retryable?(error)
        code = error_code(error)
        return false if FINAL.include?(code)
        return false if error.message.to_s.match?(/access denied|unknown database|authentication/i)

        error.is_a?(SystemCallError) || error.message.to_s.match?(RETRYABLE)
      end

      # @param driver [Symbol] :trilogy or :mysql2.
      # @return [Class<Connection>] the driver's {Connection}, its gem loaded.
      # @raise [ArgumentError] for an unknown driver.
      def connection_class(driver)
        gem, file, name = DRIVERS.fetch(driver.to_sym) do
          raise ArgumentError, "unknown MySQL driver #{driver.inspect}; use :trilogy or :mysql2"
        end
        begin
          require_relative file
        rescue LoadError => e
          raise LoadError, "NeverBlock::MySQL driver: #{driver.inspect} needs the #{gem} gem " \
                           "(add it to your Gemfile): #{e.message}"
        end
        const_get(name)
      end

      private

      def connector(connection_class, config, retries:, backoff:)
        Connector.new("#{describe(config)} (#{connection_class.driver})",
                      errors: connection_class.errors, retryable: method(:retryable?),
                      retries: retries, backoff: backoff) do
          connection_class.open(config)
        end
      end

      # The URL's options under the keywords, aliases resolved, the connect
      # timeout defaulted.
      def configuration(url, config)
        options = url ? parse_url(url) : {}
        config.each { |key, value| options[ALIASES.fetch(key.to_sym, key.to_sym)] = value }
        options[:connect_timeout] ||= DEFAULT_CONNECT_TIMEOUT
        options
      end

      NUMERIC = %i[port connect_timeout read_timeout write_timeout].freeze
      private_constant :NUMERIC

      def parse_url(url)
        uri = URI.parse(url)
        unless %w[mysql mysql2 trilogy mariadb].include?(uri.scheme)
          raise ArgumentError, "not a MySQL URL (mysql://user:password@host:port/database): #{url}"
        end

        options = {}
        options[:host] = uri.host if uri.host && !uri.host.empty?
        options[:port] = uri.port if uri.port
        options[:username] = URI.decode_www_form_component(uri.user) if uri.user
        options[:password] = URI.decode_www_form_component(uri.password) if uri.password
        database = uri.path.to_s.delete_prefix("/")
        options[:database] = URI.decode_www_form_component(database) unless database.empty?
        URI.decode_www_form(uri.query.to_s).each do |key, value|
          key = ALIASES.fetch(key.to_sym, key.to_sym)
          options[key] = NUMERIC.include?(key) ? Float(value) : value
        end
        options[:port] = Integer(options[:port]) if options[:port]
        options
      end

      # mysql://user@host:port/database, never the password.
      def describe(config)
        user = config[:username] ? "#{config[:username]}@" : ""
        host = config[:host] ? "#{config[:host]}:#{config[:port] || 3306}" : "localhost"
        socket = !config[:host] && config[:socket] ? "?socket=#{config[:socket]}" : ""
        "mysql://#{user}#{host}/#{config[:database]}#{socket}"
      end

      def error_code(error)
        if error.respond_to?(:error_code) then error.error_code
        elsif error.respond_to?(:error_number) then error.error_number
        end
      end
    end
  end
end
