# frozen_string_literal: true

require_relative "../../test_helper"
require "json"
require "net/http"
require_relative "../../support/serve_processes"
require "neverblock/server"

# What an operator reads about a cluster must be true: the master's process
# title follows TTIN, a stopped worker is not said to be computing, request
# timeouts reach /metrics and /stats, a wrong control token is called wrong.
class ServerOperatorMessagesTest < PlainTest
  include ServeProcesses

  TOKEN = "op-token"

  def test_the_process_title_follows_ttin_and_ttou
    server = serve("pids.ru", "-w", "2")
    eventually { worker_pids(server[:pid]).size == 2 }
    assert_match(/neverblock master \(2 workers\)/, title(server[:pid]))
    Process.kill("TTIN", server[:pid])
    eventually { worker_pids(server[:pid]).size == 3 }
    assert_match(/neverblock master \(3 workers\)/, title(server[:pid]))
    Process.kill("TTOU", server[:pid])
    eventually { title(server[:pid]).include?("(2 workers)") }
  end

  def test_a_stopped_worker_is_reported_as_stopped_not_as_a_request_holding_it
    server = serve("pids.ru", "-w", "1", "--worker-timeout", "1")
    worker = eventually { (w = worker_pids(server[:pid])).size == 1 && w.first }
    Process.kill("STOP", worker)
    line = wait_for_line(server, /\(pid #{worker}\) has not turned its event loop/, timeout: 30)
    assert_match(/it is stopped \(SIGSTOP, or a debugger holds it\)/, line)
    refute_match(/a request holds it/, line)
    eventually { !worker_pids(server[:pid]).include?(worker) && worker_pids(server[:pid]).size == 1 }
  end

  def test_request_timeouts_reach_metrics_and_stats_and_a_wrong_token_is_called_wrong
    server = serve("pids.ru", "-w", "1", "--request-timeout", "0.3", "--control", "tcp://127.0.0.1:0", "--control-token", TOKEN)
    port = Integer(wait_for_line(server, /control listener on tcp:\/\/127\.0\.0\.1:(\d+)/)[/:(\d+)\s*$/, 1])
    assert_equal "503", get(server, "/slow?2").code
    metrics = eventually do
      body = control_get(port, "/metrics", TOKEN).body
      body.match?(/^neverblock_request_timeouts_total\{worker="0"\} 1$/) && body
    end
    assert_match(/# TYPE neverblock_request_timeouts_total counter/, metrics)
    stats = JSON.parse(control_get(port, "/stats", TOKEN).body)
    assert_equal 1, stats["workers"].first.dig("metrics", "requests_timed_out")

    wrong = control_get(port, "/stats", "not-it")
    assert_equal "401", wrong.code
    assert_match(/\Awrong token/, wrong.body)
    missing = control_get(port, "/stats", nil)
    assert_equal "401", missing.code
    assert_match(/\Aa token is needed/, missing.body)
  end

  def test_a_rolling_restart_says_when_it_is_done_and_a_stop_says_stopped
    server = serve("pids.ru", "-w", "2")
    old_workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    Process.kill("USR2", server[:pid])
    wait_for_line(server, /rolling restart done in [\d.]+ s: generation 1, 2 workers serving/, timeout: 60)
    assert old_workers.none? { |pid| File.exist?("/proc/#{pid}") }, "said done once every old worker had exited"
    Process.kill("TERM", server[:pid])
    wait_for_line(server, /master stopped [\d.]+ s after it was asked to: every worker exited/, timeout: 60)
    assert wait_exit(server).success?
  end

  def test_a_refork_says_when_the_new_generation_took_over
    skip NeverBlock::Server::Cluster::Refork.unavailable if NeverBlock::Server::Cluster::Refork.unavailable

    server = serve("refork.ru", "-w", "2", "--refork-after", "5,false")
    mold = eventually(timeout: 60) do
      get(server)
      output_lines(server).join[/\(pid (\d+)\) is the mold/, 1]
    end
    wait_for_line(server, /refork done in [\d.]+ s: generation 1 forked from the mold \(pid #{mold}\), 2 workers serving/, timeout: 60)
  end

  def test_ctl_phased_restart_is_logged_as_asked_over_the_control_listener_not_as_a_signal
    server = serve("pids.ru", "-w", "1", "--control", "tcp://127.0.0.1:0", "--control-token", TOKEN)
    port = Integer(wait_for_line(server, /control listener on tcp:\/\/127\.0\.0\.1:(\d+)/)[/:(\d+)\s*$/, 1])
    assert_equal "200", control_post(port, "/phased-restart").code
    wait_for_line(server, /master asked over the control listener \(POST \/phased-restart\): rolling restart \(1 worker\)/)
    wait_for_line(server, /rolling restart done/, timeout: 60)
    refute_match(/master got USR2/, output_lines(server).join)
  end

  def test_the_workers_of_a_master_killed_by_sigkill_say_why_they_stop
    server = serve("pids.ru", "-w", "2")
    workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    Process.kill("KILL", server[:pid])
    workers.each do |pid|
      wait_for_line(server, /worker \d \(pid #{pid}\) stops: its master \(pid #{server[:pid]}\) is gone/, timeout: 30)
    end
    eventually(timeout: 30) { workers.none? { |pid| alive?(pid) } }
  end

  def test_old_workers_retired_by_a_hot_restart_do_not_say_their_master_is_gone
    server = serve("pids.ru", "-w", "2")
    old_workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    Process.kill("HUP", server[:pid])
    wait_for_line(server, /hot restart done; the old workers/, timeout: 60)
    eventually(timeout: 30) { old_workers.none? { |pid| File.exist?("/proc/#{pid}") } }
    refute_match(/is gone/, output_lines(server).join)
  end

  private

  def control_post(port, path)
    Net::HTTP.start("127.0.0.1", port, open_timeout: 2, read_timeout: 5) do |http|
      http.post(path, "", "authorization" => "Bearer #{TOKEN}")
    end
  end

  def title(pid)
    File.read("/proc/#{pid}/cmdline").tr("\0", " ")
  end

  def control_get(port, path, token)
    Net::HTTP.start("127.0.0.1", port, open_timeout: 2, read_timeout: 5) do |http|
      http.get(path, token ? { "authorization" => "Bearer #{token}" } : {})
    end
  end
end
