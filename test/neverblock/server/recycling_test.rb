# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "tmpdir"
require "neverblock/server"

# `max_requests` and `max_memory`: a worker past either is replaced
# gracefully (its successor accepts before it stops, so no request fails),
# one worker at a time; and the hooks a Puma config uses.
class ServerRecyclingTest < PlainTest
  include ServeProcesses

  def test_max_requests_replaces_a_worker_after_its_requests_without_failing_one
    server = serve("pids.ru", "-w", "1", "--max-requests", "20")
    first = eventually { (w = worker_pids(server[:pid])).size == 1 && w.first }
    served_by = []
    eventually(timeout: 30) do
      served_by << pids(server).first # asserts 200
      served_by.uniq.size > 1
    end
    assert_operator served_by.count(first), :>=, 20, "not before max_requests"
    assert_operator served_by.count(first), :<=, 22 + 40, "about when it passed max_requests (+ jitter, + a heartbeat's worth)"
    assert_match(/worker 0 \(pid #{first}\) served \d+ requests \(max_requests 2[0-2]\): replacing it, its successor first/,
                 output_lines(server).join)
  end

  # Both workers leak; they are replaced one at a time (never more than one
  # successor alive), and requests go on being answered throughout.
  def test_max_memory_replaces_leaking_workers_one_at_a_time_without_failing_a_request
    server = serve("leak.ru", "-w", "2")
    baseline = eventually { (w = worker_pids(server[:pid])).size == 2 && w.map { |pid| rss(pid) }.max }
    stop_and_wait_for(server)
    limit = baseline + (40 * 1024 * 1024)
    server = serve("leak.ru", "-w", "2", "--max-memory", limit.to_s)
    original = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    most = 0
    eventually(timeout: 60) do
      response = get(server, "/leak")
      assert_equal "200", response.code
      most = [most, worker_pids(server[:pid]).size].max
      (worker_pids(server[:pid]) & original).empty?
    end
    assert_operator most, :<=, 3, "one successor at a time"
    log = output_lines(server).join
    replaced = log.scan(/\(pid (\d+)\) uses \d+ MB of RSS, over max_memory \d+ MB: replacing it, its successor first/).flatten
    assert_empty original.map(&:to_s) - replaced, log # (their successors leak too, and may be replaced as well)
  end

  # Two workers found past their limit on one turn: the log says they go one
  # at a time, not "its successor first" twice in the same millisecond.
  def test_workers_retired_on_one_turn_are_logged_as_replaced_one_after_the_other
    watchdog = Class.new do
      include NeverBlock::Server::Cluster::Watchdog
      public :retire

      def initialize
        @retiring = []
        @stopping = false
      end
    end.new
    worker = Struct.new(:index, :pid, :requests, :max_requests, :retiring, :stopping) do
      def to_s = "worker #{index} (pid #{pid})"
    end
    log = capture_log do
      watchdog.retire(worker.new(0, 101, 21, 20), :requests)
      watchdog.retire(worker.new(1, 102, 22, 20), :requests)
    end
    first, second = log.lines.grep(/replacing it/)
    assert_match(/worker 0 \(pid 101\) served 21 requests \(max_requests 20\): replacing it, its successor first$/, first)
    assert_match(/worker 1 \(pid 102\) served 22 requests \(max_requests 20\): replacing it, its successor first; after worker 0 \(pid 101\)'s replacement \(one at a time\)$/,
                 second)
  end

  def test_hooks_run_where_puma_runs_them
    Dir.mktmpdir do |dir|
      events = File.join(dir, "events")
      File.write(File.join(dir, "config.rb"), <<~RUBY)
        on_booted { File.write(#{events.inspect}, "booted\\n", mode: "a") }
        on_restart { File.write(#{events.inspect}, "restart\\n", mode: "a") }
        before_worker_shutdown { |index| File.write(#{events.inspect}, "shutdown \#{index}\\n", mode: "a") }
        after_worker_exit { |index, status| File.write(#{events.inspect}, "exit \#{index} \#{status.exitstatus}\\n", mode: "a") }
      RUBY
      server = serve("pids.ru", "-w", "1", "-C", File.join(dir, "config.rb"))
      eventually { File.exist?(events) && File.read(events) == "booted\n" }
      Process.kill("USR2", server[:pid])
      eventually { File.read(events).include?("exit 0 0") }
      Process.kill("TERM", server[:pid])
      wait_exit(server)
      assert_equal ["booted", "restart", "shutdown 0", "exit 0 0", "shutdown 0", "exit 0 0"], File.read(events).lines.map(&:chomp)
    end
  end

  def test_a_hook_that_raises_is_logged_and_the_master_goes_on
    Dir.mktmpdir do |dir|
      File.write(File.join(dir, "config.rb"), "after_worker_exit { |_index, _status| raise 'hook broke' }\n")
      server = serve("pids.ru", "-w", "1", "-C", File.join(dir, "config.rb"))
      worker = eventually { (w = worker_pids(server[:pid])).size == 1 && w.first }
      Process.kill("KILL", worker)
      wait_for_line(server, /the after_worker_exit hook raised RuntimeError: hook broke/)
      eventually { (w = worker_pids(server[:pid])).size == 1 && w.first != worker }
      pids(server)
    end
  end

  private

  def rss(pid)
    File.read("/proc/#{pid}/status")[/^VmRSS:\s+(\d+) kB/, 1].to_i * 1024
  end

  def stop_and_wait_for(server)
    Process.kill("TERM", server[:pid])
    wait_exit(server)
  end
end
