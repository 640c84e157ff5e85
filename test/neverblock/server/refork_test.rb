# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "neverblock/server"
require "neverblock/cli/config_file"
require "open3"
require "tmpdir"

# Reforking: a worker that warmed up becomes the mold the next generation of
# workers is forked from (refork_after, URG, `neverblock ctl refork`). The
# fixture answers "PID WARMED_IN": a worker forked from the mold answers the
# mold's pid there, because it inherited the mold's warmed-up memory.
class ServerReforkTest < PlainTest
  include ServeProcesses
  include NeverBlockTest::Databases

  def setup
    skip NeverBlock::Server::Cluster::Refork.unavailable if NeverBlock::Server::Cluster::Refork.unavailable
  end

  def test_a_refork_under_keep_alive_load_loses_no_request_and_the_new_generation_shares_the_molds_memory
    server = serve("refork.ru", "-w", "2", "--refork-after", "200,false")
    first_generation = eventually { (w = workers(server)).size == 2 && w }
    answers = Queue.new
    errors = Queue.new
    clients = Array.new(4) { keep_alive_client(server[:port], answers, errors) }
    mold = Integer(wait_for_line(server, /\(pid (\d+)\) is the mold/, timeout: 60)[/\(pid (\d+)\) is the mold/, 1])
    seen = []
    # Until both indexes answer from the mold and the first generation's
    # other worker has drained its keep-alive connections and exited (on a
    # loaded machine that can take longer than the new workers' start).
    eventually(timeout: 30) do
      seen << answers.pop until answers.empty?
      seen.count { |pid, warmed| warmed == mold && pid != mold } >= 20 &&
        seen.map(&:first).uniq.count { |pid| seen.assoc(pid).last == mold } >= 2 && # both indexes, from the mold
        (first_generation - [mold]).none? { |pid| alive?(pid) }
    end
    settled = seen.size
    eventually(timeout: 30) do # a little more load on the new generation
      seen << answers.pop until answers.empty?
      seen.size - settled >= 20
    end
    @hammering = false
    clients.each(&:join)
    assert_empty errors.size.times.map { errors.pop }, "requests lost during the refork"
    # The newest answers are those after the first generation had gone (an
    # answer that worker gave while draining may be among the last `seen`).
    seen << answers.pop until answers.empty?
    newest = seen.drop(settled).last(20).map(&:first).uniq
    refute_empty newest, "the new generation answered after the first had gone"
    newest.each { |pid| assert_equal mold, seen.assoc(pid).last, "pid #{pid} was not forked from the mold" }
    newest.each { |pid| assert_equal server[:pid], parent(pid), "the master adopts the workers the mold forks" }
    assert_includes process_title(mold), "neverblock mold"
  end

  def test_repeated_reforks_under_keep_alive_load_lose_no_request
    server = serve("refork.ru", "-w", "2", "--refork-after", "50,100") # 100 repeats: a refork every ~100 requests of one
    answers = Queue.new
    errors = Queue.new
    clients = Array.new(4) { keep_alive_client(server[:port], answers, errors) }
    eventually(timeout: 90) do
      answers.clear
      output_lines(server).join.scan(/is the mold; forking generation (\d+)/).flatten.last.to_i >= 4
    end
    molds = []
    seen = []
    eventually(timeout: 30) do # the newest answers come from workers forked from a mold
      molds = output_lines(server).join.scan(/\(pid (\d+)\) is the mold/).flatten.uniq.map { |pid| Integer(pid) }
      seen << answers.pop until answers.empty?
      seen.size >= 10 && seen.last(10).all? { |_, warmed| molds.include?(warmed) }
    end
    @hammering = false
    clients.each(&:join)
    assert_empty errors.size.times.map { errors.pop }, "requests lost across #{molds.size} reforks"
    assert_operator molds.size, :>=, 4, "each of the 4 reforks has a mold of its own"
  end

  # Each worker's memory is read once both answer from the mold's cache,
  # and read again until both share it or the time is up: on a loaded
  # machine a worker may be replaced between the two looks, and its
  # successor builds a cache of its own. A CI pass twice measured a worker
  # whose cache was all private; a failure now shows the mold's memory and
  # the server's log beside it, to tell what the worker's cache was shared
  # with.
  def test_the_next_generation_shares_a_cache_built_after_boot
    started = now
    server = serve("refork.ru", "-w", "2", "--refork-after", "20,false", env: { "NB_REFORK_CACHE_MB" => "100" })
    mold = nil
    memories = nil
    looks = 0
    looked_at = molds_memory = nil
    deadline = now + 150
    until memories && memories.values.all? { |memory| shares_cache?(memory) } || now > deadline
      get(server)
      mold ||= output_lines(server).join[/\(pid (\d+)\) is the mold/, 1]&.to_i
      pids = workers(server)
      next sleep(0.1) unless mold && pids.size == 2 && pids.all? { |pid| answer_from(server, pid) == mold }

      begin
        looked = pids.to_h { |pid| [pid, smaps_rollup(pid)] }
      rescue Errno::ENOENT, Errno::ESRCH
        next # a worker gone meanwhile: look again
      end
      next unless workers(server).sort == pids.sort # (the same workers after the look)

      looks += 1
      looked_at = (now - started).round
      molds_memory = (smaps_rollup(mold) rescue "gone") # rubocop:disable Style/RescueModifier
      memories = looked
      sleep 0.5 unless memories.values.all? { |memory| shares_cache?(memory) } # (the next look, on a loaded machine)
    end
    why = "#{looks} look(s), the last #{looked_at.inspect} s after the start; the mold #{mold.inspect}: #{molds_memory.inspect}; " \
          "the server said:\n#{output_lines(server).grep(/mold|worker|refork/).last(20).join}"
    refute_nil memories, "both workers answered from the mold's cache; #{why}"
    memories.each do |pid, memory|
      assert_operator memory["Rss"], :>, 90 * 1024, "worker #{pid} maps the cache: #{memory}; #{why}"
      assert_operator memory["Rss"] - memory["Pss"], :>, 40 * 1024, "worker #{pid} shares the cache with the mold and its sibling: #{memory}; #{why}"
    end
  end

  def test_reforked_workers_keep_their_pools_their_watchdog_and_rolling_restarts
    env = { "NB_TEST_PG" => JSON.generate(pg_conninfo) }
    # --worker-timeout 5, not less: three test passes at once on two cores can hold a
    # healthy worker's heartbeat back for a few seconds, and a worker killed then starts over.
    server = serve("refork.ru", "-w", "2", "--refork-after", "10,false", "--worker-timeout", "5", env: env)
    first_generation = eventually { (w = workers(server)).size == 2 && w }
    before = []
    mold = eventually(timeout: 60) do
      before << get(server, "/backend").body.split.map { |number| Integer(number) }
      output_lines(server).join[/\(pid (\d+)\) is the mold/, 1]&.to_i
    end
    eventually(timeout: 60) { workers(server).size == 2 && workers(server).all? { |pid| answer_from(server, pid) == mold } }
    after = Array.new(12) { get(server, "/backend").body.split.map { |number| Integer(number) } }
    molds_connections = before.select { |pid, _backend| pid == mold }.map(&:last)
    refute_empty molds_connections
    assert_empty after.map(&:last) & molds_connections, "the new generation opened connections of its own"
    assert_empty after.map(&:first) & first_generation, "the new generation answered"

    hung = workers(server)
    # One /spin only: Net::HTTP sends an idempotent GET again when its
    # connection is reset, and a second worker would spin (and be killed)
    # while the rolling restart below runs.
    spinning = Thread.new do
      Net::HTTP.start("127.0.0.1", server[:port], max_retries: 0, read_timeout: 30) { |http| http.get("/spin") }
    rescue StandardError
      nil # its worker is killed
    end
    wait_for_line(server, /killed by the watchdog/, timeout: 30)
    eventually(timeout: 30) do
      (fresh = workers(server) - hung).any? && fresh.all? { |pid| answer_from(server, pid) == mold }
    end
    spinning.join(5)

    # The rolling restart drops the mold: its workers load the app anew.
    # Their refork_after counts start again, so after 10 requests one of
    # them may be the next mold: an answer names a worker of the new
    # generation as where the app was loaded, never the old mold.
    Process.kill("USR2", server[:pid])
    eventually(timeout: 30) { !alive?(mold) }
    eventually(timeout: 30) do
      (now = workers(server)).size == 2 &&
        now.all? { |pid| (loaded = answer_from(server, pid)) && !([mold] + first_generation + hung).include?(loaded) }
    end
    assert_equal "200", get(server, "/backend").code
  end

  def test_a_promotion_is_refused_while_another_thread_computes_and_says_why
    server = serve("refork.ru", "-w", "1")
    busy = Integer(get(server, "/busy").body.split.first)
    Process.kill("URG", server[:pid])
    line = wait_for_line(server, /refused to become the mold/, timeout: 30)
    assert_match(/worker 0 \(pid #{busy}\) refused to become the mold: 1 other thread\(s\) still running after \d+ s \(busy-spinner at .*refork\.ru:\d+/, line)
    eventually(timeout: 30) { (w = workers(server)).size == 1 && w.first != busy }
    pid, warmed = get(server).body.split.map { |number| Integer(number) }
    assert_equal pid, warmed, "its successor comes from the master"
    refute_match(/died|killed by the watchdog|is the mold/, output_lines(server).join)
  end

  def test_the_last_refork_after_count_repeats
    server = serve("refork.ru", "-w", "1", "--refork-after", "5,10")
    eventually(timeout: 60) do
      get(server)
      output_lines(server).join.scan(/is the mold; forking generation (\d+)/).flatten.last.to_i >= 3
    end
    log = output_lines(server).join
    assert_match(/served \d+ requests \(refork_after 5\)/, log)
    assert_operator log.scan(/served \d+ requests \(refork_after 10\)/).size, :>=, 2, log
  end

  # refork_after counted requests, and promoted a worker that had not
  # built the app's cache: refork_when says what warm means.
  def test_refork_when_holds_a_promotion_until_a_worker_reports_it_is_warm
    Dir.mktmpdir do |dir|
      config = File.join(dir, "config.rb")
      File.write(config, "refork_after 3, false\nrefork_when { |index| CACHE.any? }\n")
      server = serve("refork.ru", "-w", "2", "-C", config, env: { "NB_REFORK_WARM_PATH" => "/warm" })
      eventually(timeout: 30) do
        get(server)
        output_lines(server).join.match?(/served \d+ requests \(refork_after 3\) but is not warm yet \(refork_when\)/)
      end
      refute_match(/is the mold/, output_lines(server).join, "no worker was promoted cold")
      warmed = get(server, "/warm").body.split.map { |number| Integer(number) }.first
      mold = eventually(timeout: 60) do # (it may still have to reach the count)
        get(server)
        output_lines(server).join[/\(pid (\d+)\) served \d+ requests \(refork_after 3\) and is warm \(refork_when\)/, 1]&.to_i
      end
      assert_equal warmed, mold, "the worker that built its cache became the mold"
      wait_for_line(server, /refork done/, timeout: 60)
      workers(server).each { |pid| assert_equal mold, answer_from(server, pid, timeout: 30), "worker #{pid} has the mold's cache" }
    end
  end

  # The callable raises at each check (every heartbeat interval, 1 s at
  # --worker-timeout 5): a worker that was asked three times said so once.
  # The test counts the calls each worker made (a file they append their pid
  # to), not the time; a worker replaced meanwhile would say it once more,
  # under its own pid.
  def test_a_refork_when_that_raises_is_logged_once_and_counts_as_not_warm
    Dir.mktmpdir do |dir|
      config = File.join(dir, "config.rb")
      calls = File.join(dir, "calls")
      File.write(config, <<~RUBY)
        refork_after 2, false
        refork_when do |index|
          File.write(#{calls.inspect}, "\#{Process.pid}\\n", mode: "a") # a line per call
          raise "cache not reachable"
        end
      RUBY
      # --worker-timeout 5, not less: three test passes at once on two cores can hold a
      # healthy worker's heartbeat back for a few seconds.
      server = serve("refork.ru", "-w", "1", "--worker-timeout", "5", "-C", config)
      eventually(timeout: 30) do
        get(server)
        output_lines(server).join.match?(/served \d+ requests \(refork_after 2\) but is not warm yet/)
      end
      worker = eventually { File.exist?(calls) && File.readlines(calls, chomp: true).tally.find { |_pid, count| count >= 3 }&.first }
      5.times { get(server) }
      log = output_lines(server).join
      complaint = /\(pid #{worker}\): refork_when raised RuntimeError: cache not reachable; it counts as not warm/
      assert_equal 1, log.scan(complaint).size, log
      refute_match(/is the mold/, log)
    end
  end

  def test_refork_after_needs_request_counts
    error = assert_raises(ArgumentError) { NeverBlock::Server.new(->(_env) {}, workers: 2, refork_after: [10, 0]) }
    assert_match(/refork_after must be request counts above 0/, error.message)
    assert_equal [10, 100], NeverBlock::Server.new(->(_env) {}, workers: 2, refork_after: [10, 100]).supervision.refork_after
    assert_equal [], NeverBlock::Server.new(->(_env) {}, workers: 2).supervision.refork_after
    assert_equal [10, false], NeverBlock::Server.new(->(_env) {}, workers: 2, refork_after: [10, false]).supervision.refork_after
    assert_raises(ArgumentError) { NeverBlock::Server.new(->(_env) {}, workers: 2, refork_after: [false, 10]) }
    out, status = Open3.capture2e(RbConfig.ruby, EXE, "serve", "--refork-after", "10,x", File.join(FIXTURES, "hello.ru"))
    assert_equal 64, status.exitstatus, out
    assert_match(/--refork-after 10,x \(request counts/, out)
  end

  def test_a_config_file_sets_refork_after_and_before_refork
    Dir.mktmpdir do |dir|
      File.write(File.join(dir, "config.rb"), "refork_after 50, 500\nbefore_refork { |index| index }\nrefork_when { |index| index.zero? }\n")
      options = NeverBlock::CLI::ConfigFile.load(File.join(dir, "config.rb"))
      assert_equal [50, 500], options[:refork_after]
      assert_respond_to options[:before_refork], :call
      assert_equal [true, false], [options[:refork_when].call(0), options[:refork_when].call(1)]
    end
  end

  private

  # A client on one keep-alive connection, GET after GET, until
  # @hammering is false; Net::HTTP does not retry: a request the server
  # dropped is an error.
  def keep_alive_client(port, answers, errors)
    @hammering = true
    Thread.new do
      Net::HTTP.start("127.0.0.1", port, open_timeout: 5, read_timeout: 30) do |http|
        http.max_retries = 0
        while @hammering
          begin
            response = http.get("/")
            next errors << "#{response.code}: #{response.body}" unless response.code == "200"

            answers << response.body.split.map { |number| Integer(number) }
          rescue StandardError => e
            errors << "#{e.class}: #{e.message}"
            http.finish if http.started?
            http.start
          end
        end
      end
    end
  end

  # The pids of the master's serving workers (not its mold).
  def workers(server)
    worker_pids(server[:pid]).select { |pid| process_title(pid).include?("neverblock worker") }
  end

  # WARMED_IN of an answer from worker `pid`, nil when none came within
  # `timeout` seconds: any worker may answer, and on a loaded machine one may
  # take most of them. Inside an #eventually, keep it well under the
  # eventually's time: a worker of the old generation, listed and then
  # stopped, never answers, and the eventually must get to look again.
  def answer_from(server, pid, timeout: 8)
    deadline = NeverBlock::Clock.now + timeout
    while NeverBlock::Clock.now < deadline
      answered, warmed = get(server).body.split.map { |number| Integer(number) }
      return warmed if answered == pid
    end
    nil
  end

  def process_title(pid)
    File.read("/proc/#{pid}/cmdline").tr("\0", " ")
  rescue SystemCallError
    ""
  end

  def parent(pid)
    Integer(File.read("/proc/#{pid}/stat")[/\) \S (\d+)/, 1])
  end

  # Whether a worker's memory (#smaps_rollup) maps the 100 MB cache and
  # shares most of it.
  def shares_cache?(memory)
    memory["Rss"] > 90 * 1024 && memory["Rss"] - memory["Pss"] > 40 * 1024
  end

  # kB, by field.
  def smaps_rollup(pid)
    File.read("/proc/#{pid}/smaps_rollup").scan(/^(\w+):\s+(\d+) kB/).to_h { |name, kb| [name, Integer(kb)] }
  end

end
