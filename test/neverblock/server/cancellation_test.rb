# frozen_string_literal: true

require_relative "server_helper"

# What a request started is cancelled with it (Task::Tree): by
# request_timeout, by the end of its response, and by its client hanging
# up while the app runs (HangupWatch); a detached task goes on.
class ServerCancellationTest < PlainTest
  include ServerHelper

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    @events = Queue.new
  end

  def teardown
    @sockets&.each { |socket| socket.close unless socket.closed? }
    super
  ensure
    NeverBlock.logger = @logger
  end

  # Queue#pop(timeout:) is Ruby 3.2's.
  def pop(timeout: 30)
    Timeout.timeout(timeout) { @events.pop }
  end

  # Spawns `count` children that sleep 10 s (each reports its cancel),
  # then waits for them.
  def spawning_app(count: 3, wait: true)
    events = @events
    lambda do |_env|
      children = Array.new(count) do |index|
        NeverBlock.spawn do
          sleep 10
          events << [:child_finished, index]
        rescue NeverBlock::Cancelled
          events << [:child_cancelled, index]
          raise
        end
      end
      children.each(&:wait) if wait
      [200, { "content-type" => "text/plain", "content-length" => "3" }, ["ok\n"]]
    ensure
      events << [:app_unwound]
    end
  end

  def test_request_timeout_cancels_the_children_before_the_503
    start_server(spawning_app, request_timeout: 0.5)
    socket = connect
    socket.write(get("/"))
    status, = read_response(socket)
    assert_equal 503, status
    # All were cancelled before the 503 went out: nothing left to wait for.
    events = Array.new(4) { @events.pop(true) }
    assert_equal [[:app_unwound], [:child_cancelled, 0], [:child_cancelled, 1], [:child_cancelled, 2]], events.sort
  end

  def test_what_the_app_left_running_is_cancelled_when_its_response_is_written
    events = @events
    app = lambda do |env|
      NeverBlock.spawn do
        sleep 10
      rescue NeverBlock::Cancelled
        events << :left_running_cancelled
        raise
      end
      NeverBlock.spawn(detached: true) { sleep 0.2; events << :detached_done } if env["PATH_INFO"] == "/detached"
      [200, { "content-length" => "3" }, ["ok\n"]]
    end
    start_server(app)
    socket = connect
    socket.write(get("/detached"))
    assert_equal 200, read_response(socket).first
    assert_equal :left_running_cancelled, pop
    assert_equal :detached_done, pop
  end

  def test_a_client_that_hangs_up_gets_its_request_and_children_cancelled
    start_server(spawning_app, access_log: @access = StringIO.new)
    socket = connect
    socket.write(get("/gone"))
    sleep 0.2 # the app is waiting on its children
    socket.close
    events = Array.new(4) { pop }
    assert_equal [[:app_unwound], [:child_cancelled, 0], [:child_cancelled, 1], [:child_cancelled, 2]], events.sort
    assert_equal 1, @server.stats[:requests_hung_up]
    eventually { @access.string.include?('"GET /gone HTTP/1.1" 499') }
    assert_match(%r{GET /gone: the client hung up while the app handled it; the request was cancelled}, @log.string)
  end

  def test_a_client_that_half_closes_counts_as_gone
    start_server(spawning_app(count: 1))
    socket = connect
    socket.write(get("/"))
    socket.close_write
    assert_equal [[:app_unwound], [:child_cancelled, 0]], [pop, pop].sort
    assert_equal "", read_all(socket), "no response: the request was cancelled"
    assert_equal 1, @server.stats[:requests_hung_up]
  end

  def test_a_pipelined_next_request_is_not_taken_for_a_hang_up
    slow = lambda do |env|
      sleep 1.2 if env["PATH_INFO"] == "/slow" # past two looks of the watch
      [200, { "content-length" => "3" }, ["ok\n"]]
    end
    start_server(slow)
    socket = connect
    socket.write(get("/slow") + get("/next"))
    2.times { assert_equal 200, read_response(socket).first }
    assert_equal 0, @server.stats[:requests_hung_up]
  end

  def test_cancel_on_hangup_false_lets_the_request_run_to_its_end
    events = @events
    app = lambda do |_env|
      events << :started
      sleep 1.2
      events << :finished
      [200, { "content-length" => "3" }, ["ok\n"]]
    end
    start_server(app, cancel_on_hangup: false)
    socket = connect
    socket.write(get("/"))
    assert_equal :started, pop # the app runs: the hang-up comes while it does
    socket.close
    assert_equal :finished, pop
    assert_equal 0, @server.stats[:requests_hung_up]
  end

  def test_shutdown_timeout_cancels_the_tasks_of_the_requests_it_cancels
    start_server(spawning_app(count: 2), shutdown_timeout: 0.2)
    socket = connect
    socket.write(get("/"))
    eventually { @server.stats[:requests_in_flight] == 1 }
    @server.stop
    assert @server_thread.join(10)
    events = Array.new(3) { pop }
    assert_equal [[:app_unwound], [:child_cancelled, 0], [:child_cancelled, 1]], events.sort
  end

  def test_cancel_on_hangup_must_be_a_boolean
    assert_raises(ArgumentError) { NeverBlock::Server.new(HELLO, workers: 0, cancel_on_hangup: "yes") }
  end
end
