# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "tmpdir"

# Commands the master keeps running beside its workers (`supervise`,
# `--supervise`, SOLID_QUEUE_IN_PUMA for the app's bin/jobs): started with
# the workers, restarted when they die, left alone by a rolling restart,
# stopped with TERM when the master stops.
class ServerSuperviseTest < PlainTest
  include ServeProcesses

  APP = File.join(FIXTURES, "sidecar_app")

  def test_solid_queue_in_puma_has_the_master_supervise_bin_jobs
    Dir.mktmpdir do |dir|
      events = File.join(dir, "events")
      server = serve_app(env: { "SOLID_QUEUE_IN_PUMA" => "true", "SIDECAR_EVENTS" => events })
      first = started(events, 1).first
      assert_match(/started \d+ #{Regexp.escape(File.realpath(APP))}$/, File.read(events), "run in the app's directory")
      pids(server) # the workers serve meanwhile

      Process.kill("KILL", first)
      second = started(events, 2).last
      refute_equal first, second
      wait_for_line(server, /supervised `bin\/jobs` \(pid #{first}\) exited \(signal KILL\) after [\d.]+ s; restarting it/)

      workers = worker_pids(server[:pid]) - [second] # the master's other children
      Process.kill("USR2", server[:pid]) # a rolling restart of the workers leaves it alone
      eventually { (now = worker_pids(server[:pid]) - [second]).size == 2 && (now & workers).empty? }
      pids(server)
      assert_equal 2, File.read(events).scan(/^started/).size

      Process.kill("TERM", server[:pid])
      assert wait_exit(server).success?
      assert_includes File.read(events), "stopped #{second}\n"
      refute alive?(second)
    end
  end

  def test_supervise_in_a_config_file_and_on_the_command_line
    Dir.mktmpdir do |dir|
      events = File.join(dir, "events")
      config = File.join(dir, "config.rb")
      File.write(config, "supervise \"bin/jobs\"\n")
      server = serve_app("-C", config, "--supervise", "bin/jobs --second", env: { "SIDECAR_EVENTS" => events })
      two = started(events, 2)
      assert_equal 2, two.uniq.size
      Process.kill("TERM", server[:pid])
      assert wait_exit(server).success?
      two.each { |pid| assert_includes File.read(events), "stopped #{pid}\n" }
    end
  end

  def test_a_command_that_cannot_start_is_retried_and_logged_and_the_workers_serve
    server = serve("pids.ru", "-w", "1", "--supervise", "/nonexistent/bin/jobs")
    wait_for_line(server, %r{could not start `/nonexistent/bin/jobs` in .*: No such file or directory.*; trying again in})
    pids(server)
  end

  def test_solid_queue_in_puma_without_bin_jobs_says_so
    server = serve("pids.ru", "-w", "1", env: { "SOLID_QUEUE_IN_PUMA" => "1" })
    assert(server[:lines].any? { |line| line.include?("SOLID_QUEUE_IN_PUMA is set but") && line.include?("bin/jobs does not exist") },
           server[:lines].join)
    pids(server)
  end

  # A sidecar killed with -9 (by hand, by the OOM killer) leaves what it
  # forked: the master stops it (TERM to the sidecar's process group), as it
  # does at its own stop, instead of leaving it to run on under pid 1.
  def test_what_a_killed_sidecar_forked_is_stopped_too
    Dir.mktmpdir do |dir|
      events = File.join(dir, "events")
      server = serve_app("--supervise", "bin/jobs", env: { "SIDECAR_EVENTS" => events, "SIDECAR_CHILD" => "1" })
      first = started(events, 1).first
      child = Integer(eventually { File.read(events)[/^child (\d+)/, 1] })
      Process.kill("KILL", first)
      eventually { !running?(child) }
      second = started(events, 2).last
      second_child = Integer(eventually { File.read(events).scan(/^child (\d+)/).flatten[1] })
      Process.kill("TERM", server[:pid])
      assert wait_exit(server).success?
      eventually { !running?(second) && !running?(second_child) }
    end
  end

  private

  # Whether `pid` runs (a zombie that no one reaped yet does not).
  def running?(pid)
    File.read("/proc/#{pid}/stat").split[2] != "Z"
  rescue Errno::ENOENT, Errno::ESRCH
    false
  end

  def serve_app(*args, env:)
    serve("config.ru", "-w", "2", *args, env: env, chdir: APP)
  end

  # The pids of the first `count` starts noted in `events`.
  def started(events, count)
    eventually { File.exist?(events) && (pids = File.read(events).scan(/^started (\d+)/).flatten.map(&:to_i)).size >= count && pids }
  end
end
