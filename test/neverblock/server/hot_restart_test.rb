# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "tmpdir"
require "json"
require "net/http"

# HUP: the master executes `neverblock serve` again (same pid), keeping its
# listening sockets; the old workers serve until the new ones accept.
class ServerHotRestartTest < PlainTest
  include ServeProcesses

  def setup
    super
    @dir = Dir.mktmpdir("nb-hot")
    @version = File.join(@dir, "version")
    File.write(@version, "v1\n")
  end

  def teardown
    super
    FileUtils.rm_rf(@dir)
  end

  def test_hup_under_load_takes_a_preloaded_apps_new_code_without_failing_a_request
    server = serve("versioned.ru", "-w", "2", "--preload", env: { "NB_TEST_VERSION" => @version })
    old_workers = eventually { (w = worker_pids(server[:pid])).size == 2 && w }
    answers = Queue.new
    stop = false
    client = Thread.new do
      until stop
        begin
          response = get(server)
          answers << (response.code == "200" ? response.body.split.first : "status #{response.code}")
        rescue StandardError => e
          answers << e
        end
      end
    end
    eventually { answers.size > 20 }
    File.write(@version, "v2\n")
    Process.kill("HUP", server[:pid])
    wait_for_line(server, /hot restart done; the old workers \(#{old_workers.sort.join(', ')}|#{old_workers.sort.reverse.join(', ')}\) stop/, timeout: 60)
    eventually { (w = worker_pids(server[:pid])).size == 2 && (w & old_workers).empty? }
    count_before = answers.size
    eventually { answers.size > count_before + 20 }
    stop = true
    client.join
    seen = Array.new(answers.size) { answers.pop }
    failures = seen.reject { |answer| answer.is_a?(String) && answer.start_with?("v") }
    assert_empty failures, "every request answered through the hot restart"
    assert_equal "v2", seen.last, "the new code answers"
    assert_includes seen, "v1"
    assert alive?(server[:pid]), "the same master pid"
    assert_match(/master got HUP: hot restart/, output_lines(server).join)
    Process.kill("TERM", server[:pid])
    assert wait_exit(server).success?
  end

  # A hot restart into an app that cannot boot: the old workers go on
  # serving the old code (the master does not give up, as it would at a
  # first boot), and the next HUP, once the app is fixed, takes over.
  def test_a_hot_restart_into_an_app_that_cannot_boot_leaves_the_old_workers_serving
    server = serve("versioned.ru", "-w", "1", env: { "NB_TEST_VERSION" => @version })
    old_workers = eventually { (w = worker_pids(server[:pid])).size == 1 && w }
    assert_equal "v1", get(server).body.split.first
    File.write(@version, "broken\n")
    Process.kill("HUP", server[:pid])
    wait_for_line(server, /hot restart abandoned: the new workers exited \d+ times in a row .*broken on purpose.*keep serving/, timeout: 60)
    5.times { assert_equal "v1", get(server).body.split.first, "the old worker still answers" }
    assert alive?(server[:pid]), "the master did not give up"
    assert_equal old_workers, worker_pids(server[:pid]), "no new workers booting meanwhile"
    abandoned = output_lines(server).join[/^.*hot restart abandoned.*$/]
    refute_match(/retrying/, abandoned, "no retry is promised where none follows")
    last_failure = output_lines(server).grep(/boot failure\(s\) in a row/).last
    refute_nil last_failure, "each boot failure is logged"
    refute_match(/retrying in/, last_failure, "the failure that abandons it promises no retry")

    File.write(@version, "v3\n")
    Process.kill("HUP", server[:pid])
    wait_for_line(server, /hot restart done; the old workers \(#{old_workers.first}\) stop/, timeout: 60)
    eventually { get(server).body.split.first == "v3" }
    Process.kill("TERM", server[:pid])
    assert wait_exit(server).success?
  end

  # A second-day deploy: the control listener's token (made at start, no
  # --control-token given) still opens /stats after each of two hot restarts,
  # and the counts /stats shows carry on instead of going back to 0.
  def test_hot_restarts_keep_the_control_token_and_the_masters_counts
    port = free_port
    server = serve("versioned.ru", "-w", "1", "--control", "tcp://127.0.0.1:#{port}", env: { "NB_TEST_VERSION" => @version })
    token = wait_for_line(server, /control listener on .*\(token (\h+)\)/)[/\(token (\h+)\)/, 1]
    first = eventually { (w = worker_pids(server[:pid])).size == 1 && w.first }
    Process.kill("KILL", first) # restarts: crash 1
    eventually { (w = worker_pids(server[:pid])).size == 1 && w.first != first }
    Process.kill("USR2", server[:pid]) # generation 1
    eventually { (stats = control_stats(port, token)) && stats["generation"] == 1 && stats["workers"].all? { |w| w["ready"] } }

    2.times do |hot|
      Process.kill("HUP", server[:pid])
      eventually(timeout: 60) { output_lines(server).count { |line| line.include?("hot restart done") } == hot + 1 }
      stats = eventually { control_stats(port, token) }
      assert_equal 1, stats["generation"], "after hot restart #{hot + 1}"
      assert_equal 1, stats.dig("restarts", "crash"), "after hot restart #{hot + 1}"
      assert_equal hot + 1, stats["hot_restarts"]
      metrics = control_get(port, "/metrics", token)
      assert_equal "200", metrics.code
      assert_match(/^neverblock_hot_restarts_total #{hot + 1}$/, metrics.body)
      assert_equal "401", control_get(port, "/stats", "wrong").code, "still guarded"
    end
    assert_equal 1, output_lines(server).count { |line| line.include?("(token ") }, "the token is logged once, at the first start"
    Process.kill("TERM", server[:pid])
    assert wait_exit(server).success?
  end

  private

  def control_get(port, path, token)
    Net::HTTP.start("127.0.0.1", port, open_timeout: 2, read_timeout: 5) do |http|
      http.get(path, "authorization" => "Bearer #{token}")
    end
  end

  # @return [Hash, nil] nil while the listener does not answer 200 (the
  #   new image opens it again after the exec).
  def control_stats(port, token)
    response = control_get(port, "/stats", token)
    JSON.parse(response.body) if response.code == "200"
  rescue SystemCallError, IOError, Net::OpenTimeout, Net::ReadTimeout
    nil
  end
end
