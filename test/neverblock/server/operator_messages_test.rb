# frozen_string_literal: true

require_relative "../../test_helper"
require "json"
require "net/http"
require_relative "../../support/serve_processes"

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

  private

  def title(pid)
    File.read("/proc/#{pid}/cmdline").tr("\0", " ")
  end

  def control_get(port, path, token)
    Net::HTTP.start("127.0.0.1", port, open_timeout: 2, read_timeout: 5) do |http|
      http.get(path, token ? { "authorization" => "Bearer #{token}" } : {})
    end
  end
end
