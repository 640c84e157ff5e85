# frozen_string_literal: true

require_relative "server_helper"
require "json"
require "rbconfig"

# How many requests and connections the server holds at once: `fiber_pool`
# bounds requests being answered, `max_connections` bounds open
# connections, and an idle keep-alive connection costs neither a request
# fiber nor much memory.
class ServerConcurrencyTest < PlainTest
  include ServerHelper

  # GET /block waits until the test releases it; anything else answers at once.
  def blocking_app(release)
    lambda do |env|
      release.pop if env["PATH_INFO"] == "/block"
      [200, { "content-length" => "2" }, ["ok"]]
    end
  end

  def test_a_request_beyond_fiber_pool_waits_for_a_free_slot_and_is_not_dropped
    release = Queue.new
    start_server(blocking_app(release), fiber_pool: 2, idle_timeout: 60)
    waiting = connect # accepted and idle while the two slots get taken
    waiting.write(get)
    read_response(waiting)
    blocked = 2.times.map { connect.tap { |socket| socket.write(get("/block")) } }
    eventually { @server.stats[:requests_in_flight] == 2 }

    waiting.write(get)
    eventually { @server.stats[:fiber_pool][:queued] == 1 }
    refute waiting.wait_readable(0.3), "answered while both request slots were taken"

    release << true
    assert_equal [200, "ok"], read_response(waiting).values_at(0, 2)
    release << true
    assert_equal [200, 200], blocked.map { |socket| read_response(socket)[0] }
  end

  # Slowloris: clients that send part of a head and then trickle (or
  # nothing) take no request slot, so complete requests are answered at
  # once instead of after header_timeout, and the server keeps accepting.
  def test_connections_sending_partial_heads_do_not_hold_request_slots
    start_server(fiber_pool: 2, header_timeout: 20)
    loris = Array.new(50) { connect.tap { |socket| socket.write("GET / HTTP/1.1\r\nHost: a\r\nX-Slow: ") } }
    eventually { @server.stats[:connections] == 50 }
    assert_equal 0, @server.stats[:fiber_pool][:busy]
    seconds = elapsed do
      clients = Array.new(10) { connect.tap { |socket| socket.write(get) } }
      assert_equal [200] * 10, clients.map { |socket| read_response(socket, timeout: 15)[0] }
    end
    assert_operator seconds, :<, 5, "complete requests waited behind partial heads"
    loris.first.write("x\r\n\r\n") # a slow head that completes is served too
    assert_equal 200, read_response(loris.first)[0]
  ensure
    loris&.each(&:close)
  end

  def test_an_idle_keep_alive_connection_holds_no_request_fiber
    start_server(fiber_pool: 1, idle_timeout: 60)
    idle = connect
    idle.write(get)
    assert_equal 200, read_response(idle)[0]
    eventually { @server.stats[:idle_connections] == 1 }

    other = connect
    other.write(get)
    assert_equal 200, read_response(other, timeout: 5)[0]
    idle.write(get) # the idle one was kept open all along
    assert_equal 200, read_response(idle, timeout: 5)[0]
  end

  def test_over_max_connections_new_connections_wait_in_the_backlog_and_are_served_later
    start_server(max_connections: 2, idle_timeout: 60)
    open = 2.times.map do
      socket = connect
      socket.write(get)
      read_response(socket)
      socket
    end
    waiting = connect # the kernel completes the handshake; the server does not accept it yet
    waiting.write(get)
    refute waiting.wait_readable(0.3), "a connection over max_connections was served"
    assert_equal 2, @server.stats[:connections]

    open.first.close
    assert_equal 200, read_response(waiting, timeout: 5)[0]
    open.last.write(get)
    assert_equal 200, read_response(open.last)[0]
  end

  def test_stats_count_idle_connections_and_requests
    release = Queue.new
    start_server(blocking_app(release), fiber_pool: 3, idle_timeout: 60)
    idle = connect
    idle.write(get)
    read_response(idle)
    busy = connect
    busy.write(get("/block"))
    eventually { @server.stats[:requests_in_flight] == 1 }
    stats = @server.stats
    assert_equal({ connections: 2, idle_connections: 1, requests_in_flight: 1, requests_total: 2 },
                 stats.slice(:connections, :idle_connections, :requests_in_flight, :requests_total))
    assert_equal({ size: 3, busy: 1 }, stats[:fiber_pool].slice(:size, :busy))
    release << true
    read_response(busy)
  end

  CONNECTIONS = 10_000
  RSS_LIMIT_MB = 300

  # The server runs in a child process, so its RSS is its own.
  SERVER = <<~RUBY
    require "neverblock/server"
    require "json"
    server = nil
    app = lambda do |env|
      body = env["PATH_INFO"] == "/stats" ? JSON.generate(server.stats) : "ok"
      [200, { "content-length" => body.bytesize.to_s }, [body]]
    end
    server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0, idle_timeout: 300)
    puts server.bound_addresses.first[/\\d+\\z/]
    $stdout.flush
    trap("TERM") { server.stop }
    server.run
  RUBY

  def test_ten_thousand_idle_keep_alive_connections_are_cheap
    known_failure_on :select, bug: "the Select selector's per-IO bookkeeping takes 10,000 connections to 302-306 MB, over the 300 MB bound"
    soft, hard = Process.getrlimit(:NOFILE)
    needed = CONNECTIONS + 256
    skip "needs an open-file hard limit of #{needed} (ulimit -Hn is #{hard})" if hard < needed

    Process.setrlimit(:NOFILE, hard, hard)
    reader, writer = IO.pipe
    pid = Process.spawn(RbConfig.ruby, "-I#{File.expand_path('../../../lib', __dir__)}", "-e", SERVER,
                        out: writer, rlimit_nofile: [hard, hard])
    writer.close
    assert reader.wait_readable(30), "the server did not start"
    port = Integer(reader.gets)

    sockets = []
    open_idle_connections(port, sockets)
    rss_mb = Integer(File.read("/proc/#{pid}/status")[/^VmRSS:\s+(\d+) kB/, 1]) / 1024.0

    stats = nil
    seconds = elapsed do
      socket = TCPSocket.new("127.0.0.1", port)
      socket.write(get("/stats"))
      stats = JSON.parse(read_response(socket)[2])
      socket.close
    end
    assert_equal CONNECTIONS + 1, stats["connections"]
    assert_operator stats["idle_connections"], :>=, CONNECTIONS
    assert_operator seconds, :<, 2, "a new request took #{seconds.round(2)} s next to #{CONNECTIONS} idle connections"
    assert_operator rss_mb, :<=, RSS_LIMIT_MB, "server RSS #{rss_mb.round} MB with #{CONNECTIONS} idle connections"
  ensure
    sockets&.each(&:close)
    stop_child(pid) if pid
    reader&.close
    Process.setrlimit(:NOFILE, soft, hard) if soft
  end

  private

  def stop_child(pid)
    Process.kill(:TERM, pid)
    deadline = now + 20
    until Process.wait(pid, Process::WNOHANG)
      next sleep(0.05) if now < deadline

      Process.kill(:KILL, pid)
      Process.wait(pid)
      break
    end
  end

  # Opens the connections in batches, adding them to `sockets`: each does
  # one request, reads the response and stays open.
  def open_idle_connections(port, sockets)
    request = get("/")
    CONNECTIONS.times.each_slice(500) do |slice|
      batch = slice.map { TCPSocket.new("127.0.0.1", port).tap { |socket| sockets << socket } }
      batch.each { |socket| socket.write(request) }
      batch.each do |socket|
        response = +""
        until response.end_with?("\r\n\r\nok")
          flunk "no response within 10 s" unless socket.wait_readable(10)
          response << socket.readpartial(1024)
        end
      end
    end
  end
end
