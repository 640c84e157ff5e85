# frozen_string_literal: true

require "test_helper"
require "net/http"
require "neverblock/io_select" # IO.select through the loop on Ruby 3.1 too (a no-op on 3.2+)

# The Fiber::Scheduler hooks, through the ordinary blocking APIs that call them.
class SchedulerTest < NeverBlockTest
  def test_io_wait_with_a_timeout_returns_falsy_when_nothing_arrives
    reader, writer = IO.pipe
    refute reader.wait_readable(0.02)
    writer.write("z")
    assert reader.wait_readable(1)
  ensure
    reader&.close
    writer&.close
  end

  # Scheduler#wake_next (what a pool checkin uses): the caller runs on; the
  # woken fiber runs in its place at the caller's next wait, ahead of
  # fibers woken before it.
  def test_wake_next_runs_the_fiber_at_the_callers_next_wait_ahead_of_the_ready_queue
    scheduler = Fiber.scheduler
    events = []
    blocked = {}
    waiters = %i[earlier handed].map do |name|
      NeverBlock.spawn do
        blocked[name] = Fiber.current
        events << [name, scheduler.block(:a_blocker, nil)]
      end
    end
    scheduler.wake(blocked[:earlier], :woken)
    scheduler.wake_next(blocked[:handed], :given)
    events << :caller_went_on
    sleep 0 # a wait: `handed` runs in its place
    assert_equal [:caller_went_on, %i[handed given], %i[earlier woken]], events
    waiters.each(&:wait)
  end

  # A caller that waits on IO next lets the fiber run first, at the start of
  # its wait (the selector's wait can only switch to the loop).
  def test_wake_next_runs_the_fiber_first_when_the_caller_waits_on_io
    scheduler = Fiber.scheduler
    reader, writer = IO.pipe
    events = []
    blocked = {}
    waiters = %i[earlier handed].map do |name|
      NeverBlock.spawn do
        blocked[name] = Fiber.current
        scheduler.block(:a_blocker, nil)
        events << name
      end
    end
    scheduler.wake(blocked[:earlier])
    scheduler.wake_next(blocked[:handed])
    events << :caller_waits
    assert_nil reader.wait_readable(0.01)
    assert_equal %i[caller_waits handed earlier], events
    waiters.each(&:wait)
  ensure
    reader&.close
    writer&.close
  end

  # The caller's timed IO wait gives way before its timer starts: a fiber
  # that runs longer than the timeout must not use it up meanwhile (the
  # timer fired while the caller gave way, and its wait then never ended).
  def test_wake_next_before_a_timed_io_wait_keeps_the_wait_s_timeout
    reader, writer = IO.pipe
    holder = wake_next_a_fiber_that_holds_the_loop(0.05)
    result = NeverBlock.timeout(5) { reader.wait_readable(0.01) }
    assert_nil result, "the timed wait ended by its timeout"
    holder.wait
  ensure
    reader&.close
    writer&.close
  end

  # So does a read's IO#timeout (the io_read hook's timer): it times the
  # read, not the fiber that ran first (which timed the read out before it
  # had looked at its IO, with the data there).
  def test_wake_next_before_a_read_leaves_the_read_its_io_timeout
    skip "IO#timeout needs Ruby 3.2" unless IO.method_defined?(:timeout=)

    reader, writer = IO.pipe
    reader.timeout = 0.01
    writer.write("z")
    holder = wake_next_a_fiber_that_holds_the_loop(0.05)
    assert_equal "z", reader.read(1)
    holder.wait
  ensure
    reader&.close
    writer&.close
  end

  # The loop fiber itself (a timer's or a posted callback) leaves the fiber
  # to the loop's next turn, as #wake.
  def test_wake_next_from_the_loop_itself_wakes_the_fiber_for_the_next_turn
    scheduler = Fiber.scheduler
    events = []
    blocked = nil
    waiter = NeverBlock.spawn do
      blocked = Fiber.current
      scheduler.block(:a_blocker, nil)
      events << :resumed
    end
    scheduler.post do
      scheduler.wake_next(blocked)
      events << :callback_done
    end
    waiter.wait
    assert_equal %i[callback_done resumed], events
  end

  # A fiber woken by #wake_next that something else resumes first (an
  # interrupt) is not resumed again by the caller's next wait.
  def test_wake_next_of_a_fiber_interrupted_first_resumes_it_once
    scheduler = Fiber.scheduler
    blocked = nil
    resumed = 0
    waiter = NeverBlock.spawn do
      blocked = Fiber.current
      scheduler.block(:a_blocker, nil)
    ensure
      resumed += 1
    end
    scheduler.wake_next(blocked)
    waiter.cancel # raised in it at its wait: it ends now
    assert_equal 1, resumed
    sleep 0 # the caller's wait finds the fiber gone and goes to the loop
    assert_raises(NeverBlock::Cancelled) { waiter.value }
    assert_equal 1, resumed
  end

  # Fibers that keep waking each other with #wake_next and waiting, without
  # IO, still let the loop run its timers and other tasks.
  def test_fibers_waking_each_other_without_io_do_not_hold_the_loop
    scheduler = Fiber.scheduler
    stop = false
    hops = 0
    fibers = []
    players = 2.times.map do |i|
      NeverBlock.spawn do
        fibers[i] = Fiber.current
        scheduler.block(:a_blocker, nil) if i.zero?
        # (Held loops give up after a million hops, to fail below rather than hang.)
        until stop || (hops += 1) > 1_000_000
          scheduler.wake_next(fibers[1 - i])
          scheduler.block(:a_blocker, nil)
        end
        scheduler.wake(fibers[1 - i])
      end
    end
    sleep 0.01 # a timer: fires while the two hand to each other without IO
    stop = true
    players.each(&:wait)
    assert_operator hops, :<=, 1_000_000, "the loop ran no timer while the two handed to each other"
  end

  def test_pipe_reads_and_writes_between_fibers
    reader, writer = IO.pipe
    consumer = NeverBlock.spawn { reader.read }
    producer = NeverBlock.spawn do
      3.times { |i| writer.write("chunk#{i};"); sleep 0.01 }
      # Where Ruby closes through blocking_operation_wait (4.0), the reader
      # can see EOF before this task has resumed from the close: wait for it too.
      writer.close
    end
    assert_equal "chunk0;chunk1;chunk2;", consumer.value
    producer.wait
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end

  def test_large_writes_to_a_slow_reader_do_not_block_other_fibers
    reader, writer = IO.pipe
    payload = "x" * (4 * 1024 * 1024) # far beyond the pipe buffer
    ticks = 0
    ticker = NeverBlock.spawn { 5.times { sleep 0.005; ticks += 1 } }
    writing = NeverBlock.spawn { writer.write(payload); writer.close }
    received = +""
    while (chunk = reader.read(65_536))
      received << chunk
      sleep 0.001 if received.bytesize < 200_000
    end
    writing.wait
    ticker.wait
    assert_equal payload.bytesize, received.bytesize
    assert_equal 5, ticks
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end

  def test_tcp_client_and_server_in_one_loop
    server = TCPServer.new("127.0.0.1", 0)
    port = server.addr[1]
    serving = NeverBlock.spawn do
      3.times.map do
        client = server.accept
        NeverBlock.spawn do
          line = client.gets
          client.write("echo #{line}")
        ensure
          client.close
        end
      end.each(&:wait)
    end
    replies = 3.times.map do |i|
      NeverBlock.spawn { TCPSocket.open("127.0.0.1", port) { |s| s.write("hello #{i}\n"); s.read } }
    end.map(&:value)
    serving.wait
    assert_equal ["echo hello 0\n", "echo hello 1\n", "echo hello 2\n"], replies
  ensure
    server&.close
  end

  def test_net_http_requests_run_concurrently
    server = TCPServer.new("127.0.0.1", 0)
    port = server.addr[1]
    acceptor = NeverBlock.spawn do
      5.times.map do
        client = server.accept
        NeverBlock.spawn do
          nil while (line = client.gets) && line != "\r\n"
          sleep 0.3
          client.write("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")
        ensure
          client.close
        end
      end.each(&:wait)
    end
    time = elapsed do
      bodies = 5.times.map { NeverBlock.spawn { Net::HTTP.get(URI("http://127.0.0.1:#{port}/")) } }.map(&:value)
      assert_equal ["ok"] * 5, bodies
    end
    acceptor.wait
    assert_operator time, :<, 1.2, "five 0.3 s requests should overlap"
  ensure
    server&.close
  end

  def test_address_resolve_matches_the_system_resolver
    expected = Addrinfo.getaddrinfo("localhost", nil, nil, :STREAM).map(&:ip_address).uniq
    assert_equal expected, Fiber.scheduler.address_resolve("localhost")
  end

  def test_address_resolve_returns_ipv6_and_ipv4_literals
    scheduler = Fiber.scheduler
    assert_equal ["::1"], scheduler.address_resolve("::1")
    assert_equal ["::1"], scheduler.address_resolve("[::1]")
    assert_equal ["127.0.0.1"], scheduler.address_resolve("127.0.0.1")
    assert_includes scheduler.address_resolve("fe80::1%lo"), "fe80::1"
  end

  def test_address_resolve_of_an_unknown_name_raises_socket_error
    assert_raises(SocketError) { Addrinfo.getaddrinfo("no-such-host.invalid", 80) }
  end

  def test_dns_lookups_do_not_block_the_loop
    ticks = 0
    ticker = NeverBlock.spawn { 3.times { sleep 0.001; ticks += 1 } }
    20.times.map { NeverBlock.spawn { Addrinfo.getaddrinfo("localhost", 80) } }.each(&:wait)
    ticker.wait
    assert_equal 3, ticks
  end

  def test_tcp_socket_resolves_names_through_the_scheduler
    server = TCPServer.new("127.0.0.1", 0)
    accepting = NeverBlock.spawn { server.accept.close }
    TCPSocket.open("localhost", server.addr[1]).close
    accepting.wait
  ensure
    server&.close
  end

  # Four three-second children: waited for one at a time that is 12 s,
  # together 3 s and whatever spawning them costs (Process.spawn holds the
  # GVL: 2.5 s more for four on a machine busy with other test passes).
  def test_process_wait_suspends_only_the_fiber
    time = elapsed do
      statuses = 4.times.map do
        NeverBlock.spawn do
          pid = Process.spawn("sleep", "3")
          Process.wait2(pid).last
        end
      end.map(&:value)
      assert statuses.all?(&:success?)
    end
    assert_operator time, :<, 8
  end

  def test_process_wait_with_wnohang_returns_at_once
    pid = Process.spawn("sleep", "0.1")
    assert_nil Process.wait(pid, Process::WNOHANG)
    assert_equal pid, Process.wait(pid)
  end

  def test_process_wait_for_any_child
    pid = Process.spawn("true")
    assert_equal pid, Process.wait(-1)
  end

  def test_exit_status_of_a_failing_child
    pid = Process.spawn("sh", "-c", "exit 3")
    _, status = Process.wait2(pid)
    assert_equal 3, status.exitstatus
  end

  # Six children that each wait until all six have started
  # (ChildRendezvous): run one at a time, the first would wait alone until
  # its deadline.
  neverblock_timeout ChildRendezvous::LIMIT + 10, :test_backticks_and_system_run_concurrently
  def test_backticks_and_system_run_concurrently
    rendezvous = ChildRendezvous.new(6)
    tasks = 3.times.map { |index| NeverBlock.spawn { `#{rendezvous.shell("backticks-#{index}", output: "out")}` } }
    tasks += 3.times.map { |index| NeverBlock.spawn { system(rendezvous.shell("system-#{index}")) } }
    values = tasks.map(&:value)
    assert rendezvous.all_together?, "the children did not all run at once: #{rendezvous.verdicts}"
    assert_equal ["out\n"] * 3 + [true] * 3, values
  ensure
    rendezvous&.close
  end

  def test_io_timeout_raises_io_timeout_error
    skip "IO#timeout needs Ruby 3.2" unless IO.method_defined?(:timeout=)

    reader, writer = IO.pipe
    reader.timeout = 0.02
    assert_raises(IO::TimeoutError) { reader.read(1) }
  ensure
    reader&.close
    writer&.close
  end

  def test_io_select_waits_for_any_of_several_ios

    r1, w1 = IO.pipe
    r2, w2 = IO.pipe
    NeverBlock.spawn { sleep 0.02; w2.write("!") }
    readable, = IO.select([r1, r2], nil, nil, 1)
    assert_equal [r2], readable
    assert_nil IO.select([r1], nil, nil, 0.01)
    ticker = NeverBlock.spawn { :ran_meanwhile }
    IO.select([r1], nil, nil, 0.02)
    assert_equal :ran_meanwhile, ticker.value
  ensure
    [r1, w1, r2, w2].each { |io| io&.close }
  end

  def test_io_select_can_be_cancelled_at_once

    reader, writer = IO.pipe
    selecting = NeverBlock.spawn { IO.select([reader]) }
    selecting.cancel
    assert_raises(NeverBlock::Cancelled) { selecting.value }
    assert selecting.cancelled?
  ensure
    reader&.close
    writer&.close
  end

  def test_io_select_keeps_waiting_when_another_fiber_takes_the_data

    reader, writer = IO.pipe
    selectors = 2.times.map do
      NeverBlock.spawn do
        IO.select([reader], nil, nil, 5)
        reader.read_nonblock(1, exception: false)
      end
    end
    writer.write("a")
    sleep 0.02
    time = elapsed do
      writer.write("b")
      assert_equal %w[a b], selectors.map(&:value).sort
    end
    assert_operator time, :<, 1, "the second selector woke on the second byte, not at its timeout"
  ensure
    reader&.close
    writer&.close
  end

  def test_io_select_on_an_io_closed_meanwhile_raises_in_that_fiber_only

    reader, writer = IO.pipe
    selecting = NeverBlock.spawn { IO.select([reader]) }
    bystander = NeverBlock.spawn { sleep 0.3; :unharmed }
    sleep 0.01
    reader.close
    assert_raises(IOError) { selecting.value }
    assert_equal :unharmed, bystander.value
  ensure
    writer&.close
  end

  # EPoll unless NEVERBLOCK_SELECTOR names another (bin/test's selector passes
  # do); selector_test.rb checks the default with the variable unset.
  def test_scheduler_selector_is_the_one_neverblock_selector_names
    expected = ENV["NEVERBLOCK_SELECTOR"].to_s.empty? ? IO::Event::Selector::EPoll : NeverBlock::Selector.resolve
    assert_equal expected, Fiber.scheduler.selector_class
  end

  private

  # Spawns a task that blocks until it is woken, and then holds the loop
  # for `seconds` (longer than the caller's next wait's timeout), and wakes
  # it with Scheduler#wake_next: it runs at the caller's next wait.
  # @return [NeverBlock::Task]
  def wake_next_a_fiber_that_holds_the_loop(seconds)
    scheduler = Fiber.scheduler
    blocked = nil
    holder = NeverBlock.spawn do
      blocked = Fiber.current
      scheduler.block(:a_blocker, nil)
      hold_until = Process.clock_gettime(Process::CLOCK_MONOTONIC) + seconds
      nil while Process.clock_gettime(Process::CLOCK_MONOTONIC) < hold_until
    end
    scheduler.wake_next(blocked)
    holder
  end
end

# Raw Fiber::Scheduler use, without NeverBlock.run.
class RawSchedulerTest < PlainTest
  def test_fiber_schedule_starts_at_once_and_close_runs_the_loop
    order = []
    thread = Thread.new do
      Fiber.set_scheduler(NeverBlock::Scheduler.new)
      Fiber.schedule do
        order << :started
        sleep 0.01
        order << :finished
      end
      order << :after_schedule
    end
    thread.join
    assert_equal %i[started after_schedule finished], order
  end

  def test_a_closed_scheduler_refuses_new_work
    scheduler = NeverBlock::Scheduler.new
    scheduler.close
    assert scheduler.closed?
    assert_raises(NeverBlock::ClosedError) { scheduler.spawn { 1 } }
    scheduler.close # idempotent
  end

  def test_fiber_schedule_inside_a_task_starts_at_once
    order = []
    NeverBlock.run do
      Fiber.schedule { order << :child; sleep 0.01; order << :child_done }
      order << :parent
    end
    assert_equal %i[child parent child_done], order
  end
end
