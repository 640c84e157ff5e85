# frozen_string_literal: true

require_relative "../test_helper"
require "tmpdir"
require "fileutils"
require "rbconfig"

# NeverBlock::ServerSemaphore in one process and across processes: the
# bound, the order within a process, timeouts, cancellation, and permits
# given back by a holder that is killed or never had them (a forked child).
# A server with two workers that share one is in
# test/neverblock/server/server_semaphore_test.rb.
class ServerSemaphoreTest < NeverBlockTest
  neverblock_timeout 30

  def setup
    @dir = Dir.mktmpdir("neverblock-semaphore")
    @children = []
  end

  def teardown
    @children.each do |child|
      Process.kill(:KILL, child[:pid])
    rescue Errno::ESRCH
      nil
    ensure
      begin
        Process.wait(child[:pid])
      rescue Errno::ECHILD
        nil
      end
      child[:out].close
      child[:in].close unless child[:in].closed?
    end
    FileUtils.rm_rf(@dir)
    super
  end

  def semaphore(limit, name: "test")
    NeverBlock::ServerSemaphore.new(name, limit, directory: @dir)
  end

  def test_the_name_and_limit_are_checked
    assert_raises(ArgumentError) { semaphore(0) }
    assert_raises(ArgumentError) { semaphore(1, name: "../etc") }
    assert_raises(ArgumentError) { semaphore(1, name: "") }
    assert_raises(ArgumentError) { semaphore(1).acquire }
  end

  def test_it_bounds_holders_across_tasks_and_gives_every_permit_back
    limited = semaphore(3)
    holding = 0
    most = 0
    tasks = Array.new(12) do
      NeverBlock.spawn do
        limited.acquire do
          holding += 1
          most = [most, holding].max
          sleep 0.01
          holding -= 1
        end
      end
    end
    NeverBlock.wait_all(tasks)
    assert_equal 3, most
    assert_equal 3, limited.available
    assert_empty limited.holder_pids
  end

  def test_two_objects_of_one_name_share_the_permits_in_a_process
    first = semaphore(1)
    second = semaphore(1)
    first.acquire do
      assert_equal 0, second.available
      assert_raises(NeverBlock::SemaphoreTimeout) { second.acquire(timeout: 0.05) { flunk "two holders" } }
    end
    assert_equal :ok, second.acquire { :ok }
  end

  def test_waiters_of_one_process_acquire_in_arrival_order
    limited = semaphore(1)
    order = []
    release = Queue.new
    holder = NeverBlock.spawn { limited.acquire { release.pop } }
    waiters = Array.new(5) do |i|
      task = NeverBlock.spawn { limited.acquire { order << i } }
      eventually { limited.waiting == i + 1 }
      task
    end
    release << true
    NeverBlock.wait_all([holder, *waiters])
    assert_equal [0, 1, 2, 3, 4], order
  end

  def test_a_timed_out_waiter_raises_semaphore_timeout_and_takes_no_permit
    limited = semaphore(1)
    release = Queue.new
    holder = NeverBlock.spawn { limited.acquire { release.pop } }
    eventually { limited.available.zero? }
    error = assert_raises(NeverBlock::SemaphoreTimeout) { limited.acquire(timeout: 0.05) { flunk "ran" } }
    assert_kind_of NeverBlock::Error, error
    assert_match(/no permit of test .*limit 1.* within 0.05 s \(held by pids #{Process.pid}\)/, error.message)
    assert_equal 0, limited.waiting
    release << true
    holder.wait
    assert_equal 1, limited.available
  end

  def test_a_cancelled_waiter_takes_no_permit_and_a_cancelled_holder_gives_it_back
    limited = semaphore(1)
    holder = NeverBlock.spawn { limited.acquire { sleep } }
    eventually { limited.available.zero? }
    waiter = NeverBlock.spawn { limited.acquire { flunk "a cancelled waiter ran" } }
    eventually { limited.waiting == 1 }
    waiter.cancel.wait
    assert_equal 0, limited.waiting
    assert_equal [Process.pid], limited.holder_pids
    holder.cancel.wait
    assert_equal 1, limited.available
    assert_raises(RuntimeError) { limited.acquire { raise "boom" } }
    assert_equal 1, limited.available
  end

  def test_an_enclosing_timeout_is_not_taken_for_the_semaphores_own
    limited = semaphore(1)
    holder = NeverBlock.spawn { limited.acquire { sleep } }
    eventually { limited.available.zero? }
    assert_raises(NeverBlock::TimeoutError) { NeverBlock.timeout(0.05) { limited.acquire(timeout: 10) { flunk "ran" } } }
    assert_equal 0, limited.waiting
    holder.cancel.wait
  end

  def test_a_holder_in_another_process_counts_and_its_permits_come_back_when_it_is_killed
    limited = semaphore(3)
    child = hold_in_child(2)
    assert_equal 1, limited.available
    assert_equal [child[:pid]] * 2, limited.holder_pids
    entered = 0
    release = Queue.new
    first = NeverBlock.spawn { limited.acquire { entered += 1; release.pop } }
    waiter = NeverBlock.spawn { limited.acquire { entered += 1 } }
    eventually { limited.waiting == 1 }
    assert_equal 1, entered

    Process.kill(:KILL, child[:pid])
    waiter.wait # the dead holder's permits came back: no one gave them back but the kernel
    assert_equal 2, entered
    release << true
    first.wait
    assert_equal 3, limited.available
  end

  def test_a_process_waits_for_permits_another_process_gives_back
    limited = semaphore(1)
    child = hold_in_child(1, release_on_input: true)
    waiter = NeverBlock.spawn { limited.acquire { limited.holder_pids } }
    eventually { limited.waiting == 1 }
    child[:in].puts("release")
    assert_equal [Process.pid], waiter.value
  end

  def test_an_idle_semaphore_holds_no_file_descriptor
    limited = semaphore(2)
    before = Dir.children("/proc/self/fd").size
    limited.acquire { assert_equal before + 1, Dir.children("/proc/self/fd").size }
    limited.available
    assert_equal before, Dir.children("/proc/self/fd").size
  end

  private

  # A child Ruby that takes `count` permits of "test" and holds them until
  # killed (or, with release_on_input, until it reads a line).
  def hold_in_child(count, release_on_input: false)
    code = <<~RUBY
      require "neverblock"
      semaphore = NeverBlock::ServerSemaphore.new("test", #{count + 1}, directory: #{@dir.inspect})
      NeverBlock.run do
        #{count}.times.map { NeverBlock.spawn { semaphore.acquire { $stdout.puts "held"; $stdout.flush; #{release_on_input ? '$stdin.gets' : 'sleep'} } } }.each(&:wait)
      end
    RUBY
    stdin_reader, stdin_writer = IO.pipe
    reader, writer = IO.pipe
    pid = Process.spawn(RbConfig.ruby, "-I#{ChildRuby::LIB}", "-e", code, in: stdin_reader, out: writer)
    stdin_reader.close
    writer.close
    child = { pid: pid, out: reader, in: stdin_writer }
    @children << child
    count.times { assert_equal "held\n", reader.gets }
    child
  end
end

# Forking outside an event loop (as a preforking server's master does).
class ServerSemaphoreForkTest < PlainTest
  def setup
    @dir = Dir.mktmpdir("neverblock-semaphore")
  end

  def teardown
    FileUtils.rm_rf(@dir)
    super
  end

  def semaphore(limit)
    NeverBlock::ServerSemaphore.new("test", limit, directory: @dir)
  end

  def test_a_child_forked_from_a_holder_holds_none_of_its_permits
    limited = semaphore(2)
    reader, writer = IO.pipe
    limited.acquire do
      pid = fork do
        reader.close
        # The parent's permit is taken; the other one is free to the child.
        free = limited.available
        held = limited.acquire(timeout: 5) do
          nested = begin
            limited.acquire(timeout: 0.05) { :three_holders }
          rescue NeverBlock::SemaphoreTimeout
            :timeout
          end
          [limited.holder_pids.sort, nested]
        end
        writer.puts [free, *held].inspect
        exit!(0)
      end
      writer.close
      assert_equal [1, [Process.pid, pid].sort, :timeout].inspect, reader.gets.chomp
      Process.wait(pid)
    end
    assert_equal 2, limited.available
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end

  def test_threads_of_a_process_share_it_outside_an_event_loop
    limited = semaphore(2)
    holding = 0
    most = 0
    lock = Mutex.new
    threads = Array.new(6) do
      Thread.new do
        limited.acquire do
          lock.synchronize { most = [most, holding += 1].max }
          sleep 0.01
          lock.synchronize { holding -= 1 }
        end
      end
    end
    threads.each(&:join)
    assert_equal 2, most
    assert_equal 2, limited.available
  end
end
