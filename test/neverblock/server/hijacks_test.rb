# frozen_string_literal: true

require_relative "server_helper"

# What the server still does for a socket the app took (full rack.hijack):
# the work of the request's task tree that serves it ends as any request's
# work ends. request_timeout closes the socket (unless the app opted out
# with env["neverblock.hijack_timeout"] = false) and cancels the tasks; a
# client that hangs up has them cancelled; a stop cancels them after the
# drain and closes their sockets. A socket handed out of the tree is left alone.
class ServerHijacksTest < PlainTest
  include ServerHelper

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    @events = Queue.new
  end

  def teardown
    super
  ensure
    NeverBlock.logger = @logger
  end

  def pop(timeout: 30)
    Timeout.timeout(timeout) { @events.pop }
  end

  SWITCHED = "HTTP/1.1 101 Switching Protocols\r\nupgrade: echo\r\nconnection: Upgrade\r\n\r\n"

  # Hijacks, answers 101, then echoes what the client sends in a task it
  # spawns (reporting the task's cancel), and returns.
  def echo_app(opt_out: false)
    events = @events
    lambda do |env|
      env[NeverBlock::Server::HIJACK_TIMEOUT] = false if opt_out
      io = env["rack.hijack"].call
      io.write(SWITCHED)
      NeverBlock.spawn do
        while (data = io.readpartial(1024))
          io.write(data)
        end
      rescue EOFError
        events << :client_closed
      rescue NeverBlock::Cancelled
        events << :task_cancelled
        raise
      ensure
        io.close
      end
      [200, {}, []]
    end
  end

  # Hijacks, answers 101, and waits a minute in a task it spawns without
  # reading the socket (a pinger, a writer of rare events).
  def waiting_app
    events = @events
    lambda do |env|
      io = env["rack.hijack"].call
      io.write(SWITCHED)
      NeverBlock.spawn do
        sleep 60
      rescue NeverBlock::Cancelled
        events << :task_cancelled
        raise
      end
      [200, {}, []]
    end
  end

  def upgrade
    get("/chat", "Upgrade: echo\r\nConnection: Upgrade\r\n")
  end

  def switched(socket)
    assert_equal 101, read_response(socket, head: true).first
    socket
  end

  def test_request_timeout_closes_a_socket_its_call_served_in_its_own_fiber
    start_server(lambda do |env|
      io = env["rack.hijack"].call
      io.write(SWITCHED)
      sleep 60 # serving the socket here
      [200, {}, []]
    end, request_timeout: 0.5)
    socket = switched(connect.tap { |client| client.write(upgrade) })
    assert_equal "", read_all(socket), "the client sees the end at the deadline, not at its own timeout"
    assert_equal 1, @server.stats[:requests_timed_out]
  end

  def test_request_timeout_closes_a_socket_a_task_serves_and_cancels_the_task
    start_server(echo_app, request_timeout: 3) # time for the echo first, on a busy machine
    socket = switched(connect.tap { |client| client.write(upgrade) })
    socket.write("ping")
    assert_equal "ping", socket.readpartial(4)
    assert_equal :task_cancelled, pop
    assert_equal "", read_all(socket)
  end

  def test_the_hijack_timeout_opt_out_keeps_the_socket_open_past_the_deadline
    start_server(echo_app(opt_out: true), request_timeout: 0.3)
    socket = switched(connect.tap { |client| client.write(upgrade) })
    sleep 1.5 # the deadline and two looks of the server's
    socket.write("still there")
    assert_equal "still there", socket.readpartial(11)
    socket.close
    assert_equal :client_closed, pop
  end

  def test_a_client_that_hangs_up_has_the_tasks_serving_its_socket_cancelled
    start_server(waiting_app)
    socket = switched(connect.tap { |client| client.write(upgrade) })
    socket.close
    assert_equal :task_cancelled, pop
  end

  def test_a_client_that_hangs_up_while_the_call_serves_the_socket_gets_it_cancelled
    events = @events
    start_server(lambda do |env|
      io = env["rack.hijack"].call
      io.write(SWITCHED)
      sleep 60
      [200, {}, []]
    rescue NeverBlock::Cancelled
      events << :call_cancelled
      raise
    end, access_log: access = StringIO.new)
    socket = switched(connect.tap { |client| client.write(upgrade) })
    socket.close
    assert_equal :call_cancelled, pop
    eventually { access.string.include?('"GET /chat HTTP/1.1" 499') }
    assert_equal 1, @server.stats[:requests_hung_up]
  end

  def test_a_stop_cancels_the_tasks_serving_hijacked_sockets_after_the_drain
    start_server(waiting_app, shutdown_timeout: 30)
    socket = switched(connect.tap { |client| client.write(upgrade) })
    eventually { @server.stats[:connections].zero? }
    @server.stop
    assert @server_thread.join(10), "Server#run waited for the hijack's task"
    @server = nil
    assert_equal :task_cancelled, pop
    assert_equal "", read_all(socket), "the server closed the socket of the task it cancelled"
  end
end
