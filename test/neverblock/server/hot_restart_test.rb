# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "tmpdir"

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

    File.write(@version, "v3\n")
    Process.kill("HUP", server[:pid])
    wait_for_line(server, /hot restart done; the old workers \(#{old_workers.first}\) stop/, timeout: 60)
    eventually { get(server).body.split.first == "v3" }
    Process.kill("TERM", server[:pid])
    assert wait_exit(server).success?
  end
end
