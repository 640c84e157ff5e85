# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "neverblock/server"
require "tmpdir"

# The master's watchdog (`worker_timeout`, `worker_boot_timeout`) and the
# task dump (QUIT), on real `neverblock serve` processes: a worker whose
# loop a request holds is asked where it is, killed and replaced, while the
# other workers go on answering.
class ServerWatchdogTest < PlainTest
  include ServeProcesses

  # --worker-timeout 5, not less (as in refork_test.rb): three test passes
  # at once on two cores can hold a healthy worker's heartbeat back for a
  # few seconds, and the watchdog then kills the worker that should stay.
  WORKER_TIMEOUT = "5"

  def test_a_worker_spinning_in_a_request_is_dumped_killed_and_replaced_while_the_other_answers
    server = serve("hang.ru", "-w", "2", "--worker-timeout", WORKER_TIMEOUT)
    before = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    steady = steady_requests(server)
    spinning = Thread.new { get(server, "/spin") rescue $! } # rubocop:disable Style/RescueModifier
    wait_for_line(server, /killed by the watchdog/)
    after = eventually { (w = worker_pids(server[:pid])).size == 2 && (w - before).any? && w }
    assert_equal 1, (before - after).size, "one worker replaced"
    answered, failed = steady.call
    assert_only_caught_with_the_stuck_worker failed, clients: 3
    # (Some on a calm machine; 3 in one CI run with three suites at once on two cores.)
    assert_operator answered, :>=, 2, "the other worker answered meanwhile"
    assert_kind_of Exception, spinning.value, "the spinning request's connection closed"
    log = output_lines(server).join
    assert_match(/worker \d \(pid \d+\) has not turned its event loop for 5\.0 s \(worker_timeout\)/, log)
    assert_match(/GET \/spin from 127\.0\.0\.1, .* holds the loop:\n    .*hang\.ru:\d+/, log, "the dump names the request and where")
  end

  # A C call that keeps the GVL stops every thread of the worker: no dump
  # can be written, and the master kills it after the grace anyway.
  def test_a_worker_stuck_in_a_c_call_holding_the_gvl_is_killed_and_replaced
    server = serve("hang.ru", "-w", "2", "--worker-timeout", WORKER_TIMEOUT)
    before = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    steady = steady_requests(server)
    Thread.new { get(server, "/gvl") rescue nil } # rubocop:disable Style/RescueModifier
    wait_for_line(server, /killed by the watchdog/, timeout: 30)
    after = eventually { (w = worker_pids(server[:pid])).size == 2 && (w - before).any? && w }
    assert_equal 1, (before - after).size
    answered, failed = steady.call
    assert_only_caught_with_the_stuck_worker failed, clients: 3
    assert_operator answered, :>, 5
  end

  def test_requests_that_wait_longer_than_the_worker_timeout_are_left_alone
    server = serve("hang.ru", "-w", "1", "--worker-timeout", WORKER_TIMEOUT)
    before = eventually { (w = worker_pids(server[:pid])).size == 1 && w }
    responses = Array.new(3) { Thread.new { get(server, "/slow?7") } }.map(&:value)
    assert_equal %w[200 200 200], responses.map(&:code)
    assert_equal before, worker_pids(server[:pid])
    refute_match(/watchdog|has not turned/, output_lines(server).join)
  end

  def test_a_worker_that_does_not_boot_in_worker_boot_timeout_is_a_boot_failure
    Dir.mktmpdir do |dir|
      File.write(File.join(dir, "config.rb"), "worker_boot_timeout 0.5\n")
      File.write(File.join(dir, "slow_boot.ru"), "sleep 30\nrun ->(_env) { [200, {}, ['booted']] }\n")
      server = spawn_serve(File.join(dir, "slow_boot.ru"), "-w", "1", "-C", File.join(dir, "config.rb"))
      wait_for_line(server, /has not accepted 0\.5 s after it was started \(worker_boot_timeout\)/)
      wait_for_line(server, /exited before its app booted \(signal KILL\); 1 boot failure/)
    end
  end

  def test_quit_makes_every_worker_log_its_requests_and_where_they_wait
    server = serve("hang.ru", "-w", "1", "--status", "/_status")
    eventually { worker_pids(server[:pid]).size == 1 }
    waiting = Thread.new { get(server, "/slow?3") }
    wait_until_in_app(server)
    Process.kill("QUIT", server[:pid])
    wait_for_line(server, /tasks:$/)
    line = wait_for_line(server, /GET \/slow\?3 from 127\.0\.0\.1/)
    assert_match(/waits:$/, line)
    assert_equal "200", waiting.value.code
    assert_match(/master got QUIT: asking every worker for its task dump/, output_lines(server).join)
  end

  def test_quit_in_single_process_mode_logs_the_tasks
    server = serve("hang.ru", "-w", "0", "--status", "/_status")
    waiting = Thread.new { get(server, "/slow?2") }
    wait_until_in_app(server)
    Process.kill("QUIT", server[:pid])
    wait_for_line(server, /GET \/slow\?2 from 127\.0\.0\.1/)
    assert_equal "200", waiting.value.code
  end

  def test_invalid_watchdog_settings_are_refused
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_) {}, workers: 1, worker_timeout: 0) }
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_) {}, workers: 1, worker_timeout: -1) }
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_) {}, workers: 1, max_requests: 0) }
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_) {}, workers: 1, max_memory: "1G") }
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_) {}, workers: 1, memory_metric: :vsz) }
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_) {}, workers: 1, on_booted: :not_callable) }
    NeverBlock::Server.new(->(_) {}, workers: 1, worker_timeout: nil, bind: "tcp://127.0.0.1:0") # off
  end

  private

  # Requests to / on fresh connections every 20 ms in a thread; the
  # returned lambda stops it and gives [answered, failures].
  # A connection the stuck worker had accepted before it stopped turning
  # dies with it (as in Puma): at most one per client, and only as a reset
  # or an end of file, never an error answer.
  def assert_only_caught_with_the_stuck_worker(failed, clients:)
    assert_operator failed.size, :<=, clients, failed.inspect
    failed.each { |error| assert_kind_of Exception, error, failed.inspect }
    failed.each { |error| assert_includes [Errno::ECONNRESET, EOFError, Errno::EPIPE], error.class, failed.inspect }
  end

  # Three clients sending one request after another (a new connection each)
  # until the returned lambda is called; it returns [answered, failed].
  # Three, because a connection the stuck worker accepted in the same turn
  # as the stuck request waits with it until the kill (Net::HTTP then
  # retries the GET): one client alone can spend the whole test there.
  def steady_requests(server, clients: 3)
    stop = false
    answered = 0
    failed = []
    threads = Array.new(clients) do
      Thread.new do
        until stop
          begin
            response = get(server)
            response.code == "200" ? answered += 1 : failed << response.code
          rescue StandardError => e
            failed << e
          end
          sleep 0.02
        end
      end
    end
    lambda do
      stop = true
      threads.each(&:join)
      [answered, failed]
    end
  end

  # Until the status shows a request in the app besides the status request.
  def wait_until_in_app(server)
    eventually { JSON.parse(get(server, "/_status").body)["requests_in_flight"] >= 2 }
  end
end
