# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/serve_processes"

# What the app leaves running past its requests (NeverBlock::Server::AppTasks):
# a detached task, a Fiber.schedule fiber, the tasks of a hijacked socket.
# They outlive their request, not the server: a stop cancels them after its
# drain, names each in the log, and then returns; and a task dump lists them
# by kind.
class ServerAppTasksTest < PlainTest
  include ServerHelper

  def setup
    super
    @log = StringIO.new
    @logger_before = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log)
  end

  def teardown
    super
  ensure
    NeverBlock.logger = @logger_before
  end

  def test_a_stop_cancels_a_detached_task_the_app_left_running_and_run_returns
    ended = Thread::Queue.new
    poller = nil
    line = __LINE__ + 2
    app = lambda do |_env|
      poller ||= NeverBlock.spawn(detached: true) do
        loop { sleep 0.2 }
      ensure
        ended << :ensure_ran
      end
      [200, { "content-length" => "3" }, ["ok\n"]]
    end
    access = StringIO.new
    start_server(app, access_log: access)
    socket = connect
    socket.write(get)
    assert_equal 200, read_response(socket)[0]

    @server.stop
    assert @server_thread.join(20), "Server#run returned after #stop"
    assert_equal :cancelled, poller.status
    assert_equal :ensure_ran, ended.pop(true), "Cancelled was raised at its wait: its ensure ran"
    site = "#{Regexp.escape(__FILE__)}:#{line}"
    assert_match(/NeverBlock::Server: stopping: cancelled #<NeverBlock::Task:0x\h+ running \(#{site}\)>, spawned detached at #{site}$/,
                 @log.string)
    assert_equal 1, @log.string.scan("stopping: cancelled").size, "only the app's task, not the server's own"
    assert_match(%r{"GET / HTTP/1\.1" 200}, access.string, "the access log was flushed")
  end

  def test_a_stop_waits_for_a_cancelled_task_that_goes_on_and_names_it
    release = Thread::Queue.new
    stubborn = nil
    line = __LINE__ + 2
    app = lambda do |_env|
      stubborn ||= NeverBlock.spawn(detached: true) do
        sleep 60
      rescue NeverBlock::Cancelled
        release.pop # it goes on after the cancel, until the test lets it end
      end
      [200, { "content-length" => "3" }, ["ok\n"]]
    end
    start_server(app, shutdown_timeout: 0.2)
    socket = connect
    socket.write(get)
    assert_equal 200, read_response(socket)[0]

    @server.stop
    warning = eventually { @log.string[/stopping: 1 task the app left running did not end when cancelled.*/m] }
    assert_match(/\n  #<NeverBlock::Task:0x\h+ running \(#{Regexp.escape(__FILE__)}:#{line}\)>, spawned detached at #{Regexp.escape(__FILE__)}:#{line}:\n    \S+/,
                 warning, "named, with its backtrace")
    refute @server_thread.join(0.1), "the stop waits for it"
    release << true
    assert @server_thread.join(20), "Server#run returned once it ended"
  end

  def test_a_stop_cancels_the_tasks_a_hijacked_socket_is_served_by
    line = __LINE__ + 3
    app = lambda do |env|
      io = env["rack.hijack"].call
      NeverBlock.spawn do # a child of the request, left running when it returns
        io.write("hello\n")
        sleep 60
      ensure
        io.close
      end
      [200, {}, []]
    end
    start_server(app, lint: false)
    socket = connect
    socket.write(get)
    assert_equal "hello\n", socket.gets
    eventually { @server.stats[:requests_in_flight].zero? }

    @server.stop
    assert @server_thread.join(20), "Server#run returned after #stop"
    assert_equal "", read_all(socket), "its ensure closed the socket"
    assert_match(/stopping: cancelled #<NeverBlock::Task:0x\h+ running \(#{Regexp.escape(__FILE__)}:#{line}\)>, left running when its parent returned$/,
                 @log.string)
  end

  # A server run inside a running loop shares it with other code: its stop
  # ends what its requests left running, and nothing of the rest.
  def test_a_stop_leaves_alone_the_tasks_other_code_runs_on_the_same_loop
    result = Thread.new do
      NeverBlock.run do
        gate = Thread::Queue.new # the host's tasks run until the test is done looking
        host_child = NeverBlock.spawn { gate.pop; :child_done }
        host_root = NeverBlock.spawn(detached: true) { gate.pop; :root_done }
        poller = nil
        app = lambda do |_env|
          poller ||= NeverBlock.spawn(detached: true) { loop { sleep 0.2 } }
          [200, { "content-length" => "3" }, ["ok\n"]]
        end
        server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0)
        port = Integer(server.bound_addresses.first[/\d+\z/])
        serving = NeverBlock.spawn { server.run }
        Net::HTTP.get(URI("http://127.0.0.1:#{port}/"))
        server.stop
        serving.wait
        statuses = [poller.status, host_child.status, host_root.status]
        2.times { gate << true }
        [statuses, host_child.value, host_root.value]
      end
    end
    assert result.join(20), "the server stopped"
    assert_equal [%i[cancelled running running], :child_done, :root_done], result.value
  end

  def test_a_task_dump_lists_the_tasks_by_kind_with_where_each_comes_from
    reached = Thread::Queue.new
    release = Thread::Queue.new
    poller = nil
    detached_line = __LINE__ + 2
    app = lambda do |_env|
      poller ||= NeverBlock.spawn(detached: true) { loop { sleep 0.2 } }
      NeverBlock.spawn { sleep 60 } # CHILD
      reached << true
      release.pop
      [200, { "content-length" => "3" }, ["ok\n"]]
    end
    child_line = detached_line + 1
    start_server(app)
    socket = connect
    socket.write(get("/held?x=1"))
    Timeout.timeout(10) { reached.pop }

    # `reached << true` wakes this thread while the request's fiber still
    # runs on to `release.pop`: until it parks there, the dump rightly says
    # it holds the loop.
    dump = eventually { (text = @server.task_dump).include?(", waits:\n") && !text.include?("holds the loop:") && text }
    file = Regexp.escape(__FILE__)
    assert_match(/\A\d+ tasks: 1 requests in flight, 1 children, 1 detached, \d+ the server's own; 1 connections; /, dump)
    assert_match(/^requests in flight \(1\):\n  GET \/held\?x=1 from 127\.0\.0\.1, in #<NeverBlock::Task:0x\h+ running [^>]*>, waits:\n    \S/,
                 dump)
    assert_match(/^children \(1\):\n  #<NeverBlock::Task:0x\h+ running \(#{file}:#{child_line}\)>, child of the request GET \/held, waits:\n    \S/,
                 dump)
    assert_match(/^detached \(1\):\n  #<NeverBlock::Task:0x\h+ running \(#{file}:#{detached_line}\)>, spawned detached at #{file}:#{detached_line}, waits:\n    \S/,
                 dump)
    release << true
    assert_equal 200, read_response(socket)[0]
  end

  private

  def failure_context
    "; log:\n#{@log&.string}"
  end
end

# The same, through `neverblock serve` (test/fixtures/server/poller.ru).
class ServeAppTasksTest < PlainTest
  include ServeProcesses

  POLLER = File.join(ServeProcesses::FIXTURES, "poller.ru")

  # The `neverblock serve` of rackup and `rails server`: one process.
  def test_neverblock_serve_with_no_workers_stops_on_term_and_says_what_it_cancelled
    server = serve(POLLER, "-w", "0")
    assert_equal "200", get(server).code
    Process.kill("TERM", server[:pid])
    assert wait_exit(server, timeout: 30).success?
    site = "#{Regexp.escape(POLLER)}:#{poller_line}"
    assert(output_lines(server).any? { |line| line.match?(/NeverBlock::Server: stopping: cancelled #<NeverBlock::Task:0x\h+ running \(#{site}\)>, spawned detached at #{site}$/) },
           "the log names the task and where it was spawned:\n#{server[:lines].join}")
  end

  # Each worker stops as soon as its requests are drained; before, the one
  # with the poller ran until the master killed it, shutdown_timeout plus
  # 5 s after the TERM.
  def test_neverblock_serve_workers_stop_on_term_well_before_the_master_kills_them
    server = serve(POLLER, "-w", "2", "--shutdown-timeout", "20")
    eventually { worker_pids(server[:pid]).size == 2 }
    4.times { assert_equal "200", get(server).code }
    Process.kill("TERM", server[:pid])
    status = nil
    took = elapsed { status = wait_exit(server, timeout: 60) }
    lines = output_lines(server)
    assert status.success?, lines.join
    refute(lines.any? { |line| line.include?("did not stop in time") }, lines.join)
    assert_operator took, :<, 15, "the kill would have come after 25 s"
    assert(lines.any? { |line| line.match?(/NeverBlock::Server: worker \d \(pid \d+\) stopping: cancelled #<NeverBlock::Task:0x\h+ running .*poller\.ru:#{poller_line}\)>/) },
           lines.join)
  end

  private

  def poller_line
    File.readlines(POLLER).index { |line| line.include?("# POLLER_LINE") } + 1
  end
end
