# frozen_string_literal: true

require_relative "server_helper"

# Errors, disconnects, concurrency, backpressure and stopping.
class ServerLifecycleTest < PlainTest
  include ServerHelper

  def test_app_exception_is_500_without_a_backtrace_and_logged
    app = ->(_env) { raise ArgumentError, "secret detail" }
    log = capture_log do
      start_server(app)
      socket = connect
      socket.write(get)
      status, _headers, body = read_response(socket)
      assert_equal [500, "Internal Server Error\n"], [status, body]
      socket.write(get) # the connection is still usable
      assert_equal 500, read_response(socket)[0]
    end
    assert_match(/ArgumentError: secret detail/, log)
    assert_match(/lifecycle_test\.rb:\d+/, log) # the backtrace goes to the log only
  end

  def test_a_head_request_whose_app_raises_gets_a_500_without_a_body
    capture_log do
      start_server(->(_env) { raise "boom" })
      socket = connect
      socket.write("HEAD / HTTP/1.1\r\nHost: a\r\n\r\n")
      status, headers, body = read_response(socket, head: true)
      assert_equal [500, "22", ""], [status, headers["content-length"], body]
      socket.write(get) # the next response follows at once: no stray body bytes
      assert_equal [500, "Internal Server Error\n"], read_response(socket).values_at(0, 2)
    end
  end

  # Not Rack-valid (Lint would refuse it), but apps do it: the client must
  # not read the surplus as the next response, nor wait for missing bytes.
  def test_a_body_longer_than_its_content_length_is_cut_and_the_connection_closed
    start_server(->(_env) { [200, { "content-length" => "2" }, ["hel", "lo"]] }, lint: false)
    socket = connect
    socket.write(get + get)
    assert_equal "he", read_response(socket)[2]
    assert_equal "", read_all(socket), "nothing more: no surplus bytes, no second response on this connection"
  end

  def test_a_body_shorter_than_its_content_length_closes_the_connection
    start_server(->(_env) { [200, { "content-length" => "10" }, ["hello"]] }, lint: false, idle_timeout: 60)
    socket = connect
    socket.write(get)
    head = read_all(socket, timeout: 5) # closed by the server now, not by the idle timeout
    assert_match(/\r\n\r\nhello\z/, head, "the five bytes, then the close tells the client the body is short")
  end

  def test_exception_while_streaming_closes_the_connection_and_is_logged
    app = lambda do |_env|
      body = Enumerator.new do |out|
        out << "partial"
        raise "broken body"
      end
      [200, { "content-type" => "text/plain" }, body]
    end
    log = capture_log do
      start_server(app)
      response = exchange(get)
      assert_match(/\AHTTP\/1\.1 200 OK\r\n.*transfer-encoding: chunked\r\n\r\n7\r\npartial\r\n\z/m, response)
    end
    assert_match(/RuntimeError: broken body/, log)
  end

  def test_response_finished_callbacks_run
    finished = Queue.new
    app = lambda do |env|
      env["rack.response_finished"] << ->(_env, status, _headers, error) { finished << [status, error] }
      [200, { "content-length" => "0" }, []]
    end
    start_server(app)
    socket = connect
    socket.write(get)
    read_response(socket)
    assert_equal [200, nil], Timeout.timeout(5) { finished.pop }
  end

  def test_client_disconnect_mid_response_leaks_nothing_and_logs_only_the_hang_ups
    baseline = fd_count
    sent = Queue.new
    app = lambda do |_env|
      body = Enumerator.new do |out|
        loop do
          out << ("x" * 65_536)
          sent << true
          sleep 0.01
        end
      end
      [200, { "content-type" => "text/plain" }, body]
    end
    log = capture_log do
      start_server(app)
      3.times do
        socket = connect
        socket.write(get)
        socket.readpartial(1000)
        socket.close
      end
      # Each connection's fiber goes back to the pool just after its ensure block.
      eventually do
        stats = @server.stats
        stats[:connections].zero? && stats[:requests_in_flight].zero? && stats[:fiber_pool][:busy].zero?
      end
      @server.stop
      assert @server_thread.join(10)
    end
    # Only the hang-ups (a line, then a summary of the others that second): no error, no backtrace.
    assert_match(/hung up/, log)
    assert_empty log.lines.grep_v(/the client hung up during its streamed response|because their client hung up/), log
    # At most the baseline: an IO of an earlier test that the GC finalizes
    # meanwhile lowers the count without anything of this test leaking.
    assert_operator fd_count, :<=, baseline, "file descriptors leaked"
  end

  def test_serves_100_slow_requests_at_once
    app = lambda do |_env|
      sleep 0.5
      [200, { "content-length" => "2" }, ["ok"]]
    end
    start_server(app)
    seconds = elapsed do
      sockets = 100.times.map { connect }
      sockets.each { |socket| socket.write(get) }
      assert_equal [200] * 100, sockets.map { |socket| read_response(socket)[0] }
    end
    assert_operator seconds, :<, 3
  end

  def test_a_full_fiber_pool_makes_connections_wait_and_drops_none
    running = 0
    peak = 0
    app = lambda do |_env|
      running += 1
      peak = [peak, running].max
      sleep 0.1
      running -= 1
      [200, { "content-length" => "2" }, ["ok"]]
    end
    start_server(app, fiber_pool: 2)
    sockets = 8.times.map { connect }
    sockets.each { |socket| socket.write(get("/", "Connection: close\r\n")) }
    assert_equal [200] * 8, sockets.map { |socket| read_response(socket)[0] }
    assert_equal 2, peak
  end

  def test_a_full_fiber_pool_accepts_no_more_connections
    release = Queue.new
    app = lambda do |_env|
      release.pop
      [200, { "content-length" => "2" }, ["ok"]]
    end
    start_server(app, fiber_pool: 1)
    first = connect
    first.write(get("/", "Connection: close\r\n"))
    eventually { @server.stats[:requests_in_flight] == 1 }
    second = connect # the kernel completes the handshake; the server does not accept it
    second.write(get("/", "Connection: close\r\n"))
    sleep 0.1
    assert_equal 1, @server.stats[:connections]
    2.times { release << true }
    assert_equal 200, read_response(first)[0]
    assert_equal 200, read_response(second)[0]
  end

  def test_stats
    release = Queue.new
    app = lambda do |_env|
      release.pop
      [200, { "content-length" => "0" }, []]
    end
    start_server(app, fiber_pool: 7)
    socket = connect
    socket.write(get)
    eventually { @server.stats[:requests_in_flight] == 1 }
    stats = @server.stats
    assert_equal({ connections: 1, requests_in_flight: 1, requests_total: 1 },
                 stats.slice(:connections, :requests_in_flight, :requests_total))
    assert_equal({ size: 7, busy: 1 }, stats[:fiber_pool].slice(:size, :busy))
    release << true
    read_response(socket)
  end

  # An app that loaded Active Support at the :thread level (concurrent
  # request fibers would share one ActiveRecord connection) is served at
  # the :fiber level, with a warning.
  def test_active_support_state_is_per_fiber_when_served
    out, err, status = run_ruby(<<~'RUBY', timeout: 30)
      require "active_support"
      require "active_support/isolated_execution_state"
      require "neverblock/server"
      require "net/http"
      ActiveSupport::IsolatedExecutionState.isolation_level = :thread
      app = ->(_env) { [200, {}, [ActiveSupport::IsolatedExecutionState.isolation_level.to_s]] }
      server = NeverBlock::Server.new(app, bind: "tcp://127.0.0.1:0", workers: 0)
      port = server.bound_addresses.first[/\d+\z/]
      thread = Thread.new { server.run }
      sleep 0.05 until (body = (Net::HTTP.get(URI("http://127.0.0.1:#{port}/")) rescue nil))
      puts body
      server.stop
      thread.join
    RUBY
    assert status.success?, err
    assert_equal "fiber\n", out
    assert_match(/isolation level was :thread; set to :fiber/, err)
  end

  # Starts a server (workers: 0) in a child Ruby whose ActiveRecord has
  # `configurations`, answers one request, stops.
  # @return [String] what the child wrote to stderr (NeverBlock's log).
  def serve_once_with_active_record(configurations, env)
    out, err, status = run_ruby(<<~RUBY, timeout: 30, env: env.merge("RAILS_ENV" => nil))
      require "active_record"
      require "neverblock/server"
      require "net/http"
      ActiveRecord::Base.configurations = #{configurations.inspect}
      server = NeverBlock::Server.new(->(_env) { [200, {}, []] }, bind: "tcp://127.0.0.1:0", workers: 0)
      port = server.bound_addresses.first[/\\d+\\z/]
      thread = Thread.new { server.run }
      sleep 0.05 until (Net::HTTP.get(URI("http://127.0.0.1:\#{port}/")) rescue nil)
      server.stop
      thread.join
      puts "stopped"
    RUBY
    assert status.success?, err
    assert_equal "stopped\n", out
    err
  end

  def test_an_activerecord_database_on_the_stock_mysql2_adapter_gets_a_warning_with_the_fix
    err = serve_once_with_active_record(
      { "development" => { "primary" => { "adapter" => "mysql2", "database" => "app" },
                           "cache" => { "adapter" => "neverblock_mysql2", "database" => "cache" } },
        "production" => { "adapter" => "mysql2", "database" => "other" } },
      { "RACK_ENV" => "development" }
    )
    warnings = err.lines.grep(/stock mysql2 adapter/)
    assert_equal 1, warnings.size, err
    assert_match(/database "primary" \(development\).*Use adapter: neverblock_mysql2/, warnings.first)
  end

  # Rails generates pool: 5 (max_connections: from 8.1); a 6th request using
  # the database at once waits checkout_timeout and fails. A Rails 8 app has
  # four databases: one short line names the small ones and the key to set.
  def test_small_activerecord_pools_get_one_short_warning_with_the_fix
    err = serve_once_with_active_record(
      { "production" => { "primary" => { "adapter" => "neverblock_postgresql", "pool" => 5 },
                          "cache" => { "adapter" => "neverblock_postgresql", "pool" => 3 },
                          "replica" => { "adapter" => "neverblock_postgresql", "pool" => 25 } } },
      { "RACK_ENV" => "production" }
    )
    warnings = err.lines.grep(/small ActiveRecord pools/)
    assert_equal 1, warnings.size, err
    key = Bundler.locked_gems.specs.find { |spec| spec.name == "activerecord" }.version >= Gem::Version.new("8.1") ? "max_connections" : "pool"
    assert_match(/small ActiveRecord pools \(production: primary 5, cache 3\): each request holds a connection to its end; set #{key}: 25 in config\/database.yml$/, warnings.first)
    assert_operator warnings.first.size, :<, 260
  end

  def test_stop_lets_in_flight_requests_finish
    app = lambda do |_env|
      sleep 0.3
      [200, { "content-length" => "4" }, ["done"]]
    end
    start_server(app)
    socket = connect
    socket.write(get)
    eventually { @server.stats[:requests_in_flight] == 1 }
    @server.stop
    status, headers, body = read_response(socket)
    assert_equal [200, "close", "done"], [status, headers["connection"], body]
    assert @server_thread.join(10)
  end

  def test_stop_closes_idle_keep_alive_connections_at_once
    start_server(idle_timeout: 60)
    socket = connect
    socket.write(get)
    read_response(socket)
    eventually { @server.stats[:requests_in_flight].zero? }
    @server.stop
    assert_equal "", read_all(socket, timeout: 5)
    assert @server_thread.join(10)
  end

  def test_stop_cancels_requests_still_running_after_the_shutdown_timeout
    cancelled = Queue.new
    app = lambda do |_env|
      sleep 60
    rescue NeverBlock::Cancelled
      cancelled << true
      raise
    end
    start_server(app, shutdown_timeout: 0.2)
    socket = connect
    socket.write(get)
    eventually { @server.stats[:requests_in_flight] == 1 }
    @server.stop
    assert @server_thread.join(10)
    assert_equal 1, cancelled.size
  end

  def test_stop_stops_accepting
    start_server
    @server.stop
    assert @server_thread.join(10)
    assert_raises(Errno::ECONNREFUSED) { TCPSocket.new("127.0.0.1", @port) }
  end

  def test_stop_from_a_signal_handler
    out, err, status = run_ruby(<<~RUBY, timeout: 30)
      require "neverblock/server"
      require "net/http"
      app = ->(_env) { [200, { "content-length" => "2" }, ["ok"]] }
      server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0)
      port = server.bound_addresses.first[/\\d+\\z/]
      trap("TERM") { server.stop }
      Thread.new do
        puts Net::HTTP.get(URI("http://127.0.0.1:\#{port}/"))
        Process.kill("TERM", Process.pid)
      end
      server.run
      puts "stopped"
    RUBY
    assert status.success?, err
    assert_equal "ok\nstopped\n", out
  end
end
