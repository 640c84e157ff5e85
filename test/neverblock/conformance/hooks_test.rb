# frozen_string_literal: true

require_relative "conformance_helper"
require "tempfile"
require "zlib"
require "socket"

# The hooks newer Rubies call (io_pread, io_close,
# blocking_operation_wait, yield, scheduler_close). Each is exercised by a
# direct call, which runs on every Ruby, and, where this Ruby calls the hook
# itself, through the ordinary API, with a subclass recording the call.
class ConformanceHooksTest < ConformanceTest
  # Records which hooks Ruby called.
  class SpyScheduler < NeverBlock::Scheduler
    def calls
      @calls ||= []
    end

    # Only the hooks the scheduler has on this Ruby (blocking_operation_wait
    # from 4.0): defining one would make Ruby call it.
    %i[io_pread io_close blocking_operation_wait].select { |hook| NeverBlock::Scheduler.method_defined?(hook) }.each do |hook|
      define_method(hook) do |*arguments|
        calls << hook
        super(*arguments)
      end
    end
  end

  def test_io_pread_reads_at_a_position_without_moving_the_file_offset
    file = tempfile("hello world")
    result = quietly_experimental do
      on_scheduler_thread do
        buffer = IO::Buffer.new(5)
        file.rewind
        hook_result { [Fiber.scheduler.io_pread(file, buffer, 6, 5, 0), buffer.get_string, file.pos] }
      end
    end
    assert_equal [5, "world", 0], result
  end

  def test_io_pread_at_the_end_of_the_file_reads_nothing
    file = tempfile("abc")
    read = quietly_experimental do
      on_scheduler_thread { hook_result { Fiber.scheduler.io_pread(file, IO::Buffer.new(4), 3, 4, 0) } }
    end
    assert_equal 0, read
  end

  def test_io_pread_on_a_pipe_returns_the_negated_errno
    known_failure_on :uring, bug: "io_pread on a pipe hangs in io-event's URing selector instead of returning -ESPIPE"
    reader, writer = IO.pipe
    result = quietly_experimental do
      on_scheduler_thread { hook_result { Fiber.scheduler.io_pread(reader, IO::Buffer.new(1), 0, 1, 0) } }
    end
    assert_equal(-Errno::ESPIPE::Errno, result)
  ensure
    reader&.close
    writer&.close
  end

  def test_io_pread_goes_through_the_hook_where_ruby_calls_it
    requires_ruby "3.3", "IO#pread calls the scheduler from 3.3"
    file = tempfile("hello world")
    scheduler = SpyScheduler.new
    result = Thread.new do
      Fiber.set_scheduler(scheduler)
      result = nil
      Fiber.schedule { result = [file.pread(5, 6), file.pread(20, 0)] }
      scheduler.run
      result
    end.value
    assert_equal ["world", "hello world"], result
    assert_includes scheduler.calls, :io_pread
  end

  # Ruby 3.3.8 and 3.4.11: a thread that called IO#pwrite through a
  # scheduler's io_pwrite hook (any scheduler's) spins forever as it exits.
  # NeverBlock defines no io_pwrite; this fails (in a child, so the suite
  # is not stuck) if one comes back.
  def test_a_thread_that_used_io_pwrite_ends
    _out, err, status = run_script(<<~RUBY, limit: 15)
      require "neverblock"
      require "tempfile"
      file = Tempfile.new("pwrite")
      Thread.new do
        Fiber.set_scheduler(NeverBlock::Scheduler.new)
        Fiber.schedule { file.pwrite("HELLO", 0) }
      end.join
      exit(File.read(file.path) == "HELLO" ? 0 : 1)
    RUBY
    assert_predicate status, :success?, err
  end

  # Ordered by events, not by time: the sweep io_close posts runs at the
  # start of the loop's next turn, before any timer can fire, whereas the
  # fallback sweep runs only every 0.1 s.
  def test_io_close_interrupts_fibers_waiting_on_the_closed_io_at_the_next_turn
    reader, writer = IO.pipe
    events = on_scheduler_thread do
      events = []
      Fiber.schedule do
        reader.read(1)
      rescue IOError => e
        events << e.message
      end
      Fiber.schedule do
        fd = reader.fileno
        reader.close
        events << :closed
        Fiber.scheduler.io_close(fd) # what Ruby 4.0 calls inside IO#close
        sleep 0.05
        events << :slept
      end
      Fiber.scheduler.run
      events
    end
    assert_equal [:closed, "stream closed in another thread", :slept], events
  ensure
    writer&.close
  end

  def test_io_close_leaves_closing_the_descriptor_to_ruby
    reader, writer = IO.pipe
    assert_nil(on_scheduler_thread { hook_result { Fiber.scheduler.io_close(reader.fileno) } })
    refute reader.closed?
    assert_equal 1, writer.write("x")
    assert_equal "x", reader.read(1)
  ensure
    reader&.close
    writer&.close
  end

  def test_closing_an_io_calls_io_close_where_ruby_calls_it
    requires_ruby "4.0", "IO#close calls the scheduler's io_close from 4.0 (3.3 and 3.4 have the call disabled)"
    reader, writer = IO.pipe
    scheduler = SpyScheduler.new
    Thread.new do
      Fiber.set_scheduler(scheduler)
      Fiber.schedule { reader.close }
    end.join
    assert_includes scheduler.calls, :io_close
    assert reader.closed?
  ensure
    writer&.close
  end

  # Scheduler#offload, which is the blocking_operation_wait hook on Ruby 4.0+.
  def test_blocking_operation_wait_runs_the_work_off_the_loop
    order = on_scheduler_thread do
      order = []
      Fiber.schedule do
        Fiber.scheduler.offload(-> { Kernel.sleep(0.1); order << :work })
        order << :returned
      end
      Fiber.schedule { order << :other_fiber_ran }
      Fiber.scheduler.run
      order
    end
    assert_equal %i[other_fiber_ran work returned], order
  end

  def test_blocking_operation_wait_holds_an_interrupted_fiber_until_the_work_ends
    events = on_scheduler_thread do
      events = []
      Fiber.schedule do
        NeverBlock.timeout(0.01) do
          Fiber.scheduler.offload(-> { Kernel.sleep(0.1); events << :work_done })
        end
      rescue NeverBlock::TimeoutError
        events << :timed_out
      end
      Fiber.scheduler.run
      events
    end
    assert_equal %i[work_done timed_out], events
  end

  # Ruby 3.4 would hand zlib to blocking_operation_wait; NeverBlock offers
  # the hook from Ruby 4.0 on only (Scheduler::BlockingWork::OFFLOAD_HOOK:
  # on 3.4, IO.copy_stream broke there), and zlib then runs in place.
  def test_zlib_runs_through_blocking_operation_wait_where_the_scheduler_offers_it
    requires_ruby "3.4", "Ruby hands GVL-free work to the scheduler from 3.4"
    data = Random.new(1).bytes(4 * 1024 * 1024)
    scheduler = SpyScheduler.new
    inflated = Thread.new do
      Fiber.set_scheduler(scheduler)
      out = nil
      Fiber.schedule { out = Zlib::Inflate.inflate(Zlib::Deflate.deflate(data)) }
      scheduler.run
      out
    end.value
    assert_equal data, inflated
    offered = NeverBlock::Scheduler::BlockingWork::OFFLOAD_HOOK
    assert_equal offered, scheduler.calls.include?(:blocking_operation_wait)
    assert_equal RUBY_VERSION >= "4.0", offered
  end

  # Two IO.copy_streams relaying a connection both ways, as a proxy does
  # (MySQLConnectTests' DelayingProxy), with a thread pool of one. Ruby 3.4
  # offered IO.copy_stream to blocking_operation_wait, and on the pool
  # thread its waits either blocked that thread in poll(2) (the other copy
  # then never ran: a hang) or called io_wait from the wrong thread (the
  # copy failed). Each copy must wait for its IOs in this loop.
  def test_io_copy_streams_relaying_both_ways_wait_in_the_loop
    client, front = UNIXSocket.pair
    back, server = UNIXSocket.pair
    replies = on_scheduler_thread(thread_pool_size: 1) do
      schedule { IO.copy_stream(front, back); back.close_write }
      schedule { IO.copy_stream(back, front); front.close_write }
      schedule { server.write(server.gets) until server.eof?; server.close_write }
      replies = []
      schedule do
        20.times { |index| client.write("#{index}\n"); replies << client.gets }
        client.close_write
      end
      replies
    end
    assert_equal 20.times.map { |index| "#{index}\n" }, replies
  ensure
    # A copy stuck on a pool thread wakes when its peers are gone.
    [client, front, back, server].each { |socket| socket&.close }
  end

  def test_yield_lets_the_other_ready_fibers_run_first
    order = on_scheduler_thread do
      order = []
      Fiber.schedule { order << :a1; Fiber.scheduler.yield; order << :a2 }
      Fiber.schedule { order << :b1; Fiber.scheduler.yield; order << :b2 }
      Fiber.scheduler.run
      order
    end
    assert_equal %i[a1 b1 a2 b2], order
  end

  def test_scheduler_close_runs_the_loop_and_closes
    finished = false
    scheduler = on_scheduler_thread do
      Fiber.schedule { sleep 0.01; finished = true }
      Fiber.scheduler.tap(&:scheduler_close)
    end
    assert finished
    assert_predicate scheduler, :closed?
  end

  private

  def tempfile(content)
    file = Tempfile.new("hooks")
    file.write(content)
    file.flush
    @tempfiles = [*@tempfiles, file]
    file
  end

  def after_teardown
    @tempfiles&.each(&:close!)
    super
  end

  # Runs the block in a scheduled fiber and the loop; returns its value.
  def hook_result(&block)
    result = nil
    Fiber.schedule { result = block.call }
    Fiber.scheduler.run
    result
  end
end
