# frozen_string_literal: true

require "fileutils"
require "json"
require "logger"
require "stringio"
require "tmpdir"
require_relative "compat_servers"

# The compatibility matrix (test/compat, rendered into docs/compatibility.md by
# bin/compat-table). Each row is one gem's own client making CALLS calls at
# once, in CALLS tasks of one NeverBlock.run, against a local server that
# answers each after DELAY seconds. Concurrent, they take about DELAY; one
# after the other, CALLS * DELAY (5 s). The test asserts the order of
# magnitude: under CONCURRENT_LIMIT, or, on a machine so loaded that it is
# not, under CALLS * DELAY with the loop never standing still for most of a
# call meanwhile. Rows whose calls start child processes (`children: true`)
# assert the concurrency itself instead: their children (#child_argv) each
# sleep DELAY and then wait until all CALLS have started (ChildRendezvous),
# which one-after-the-other calls never achieve and a loaded machine, which
# only starts children more slowly, cannot prevent (at load 8 ten such
# children took 3.3-4.6 s, and starting one could hold the loop 0.3 s).
#
# A row that blocks the loop names its fix (one of FIXES). Its test then
# shows both halves: without the fix, in a child Ruby that runs only this
# test (NEVERBLOCK_COMPAT_PROBE set), two calls run one after the other and
# the stall detector warns; with the fix, here, the ten calls run at once.
# The child is needed because a fix such as neverblock/io_select cannot be
# undone in this process once any test has required it.
#
# With NEVERBLOCK_COMPAT_RESULTS=DIR set, each row appends its result to
# DIR/ruby-VERSION.jsonl (one JSON object per line; see #record_row), which
# bin/compat-table turns into the table.
module CompatMatrix
  CALLS = 10
  DELAY = 0.5
  CONCURRENT_LIMIT = 2.5
  # Calls the blocking probe makes: two are enough to see them serialised.
  PROBE_CALLS = 2
  # Seconds the probe's calls take at the least when they run one after the
  # other: halfway between at once (DELAY) and wholly one after the other
  # (PROBE_CALLS * DELAY). Not nearer the latter: part of a call (a TCP
  # connect through the scheduler) may overlap the other even when its
  # waits hold the loop (two bunny connects over a slow link take 0.9 s of
  # 1.0), and a loaded machine only makes serial calls slower.
  PROBE_SERIAL_AT_LEAST = (PROBE_CALLS - 0.5) * DELAY
  # The stall detector's threshold (seconds) in the blocking probe.
  PROBE_STALL_THRESHOLD = 0.2

  # The fixes, as the docs name them. The first two hold the loop without
  # them (the stall detector warns) and the helper applies them; the others
  # are in the test's own calls (the `unfixed:` calls show the problem), and
  # `holds_loop: false` means the plain calls take turns while the loop
  # stays free (no stall warning).
  FIXES = {
    io_select: { text: 'require "neverblock/io_select" (Ruby 3.1 has no io_select hook)', holds_loop: true },
    defer: { text: "wrap each call in NeverBlock.defer { } (the call waits inside C)", holds_loop: true },
    connection_per_fiber: {
      text: "one Faraday connection per fiber (or per call): fibers sharing one connection of the httpx " \
            "adapter take turns, while the loop stays free",
      holds_loop: false
    }
  }.freeze

  # Runs the block CALLS times at once in tasks of one NeverBlock.run (the
  # block gets the call's index), asserts that they ran concurrently and
  # records the row.
  #
  # @param row [String] the row's name in the table, e.g. "faraday (net_http adapter)".
  # @param gem [String, nil] the gem whose loaded version the table shows;
  #   nil for Ruby's standard library.
  # @param fix [Symbol, nil] a key of FIXES when the plain calls are not
  #   concurrent on this Ruby; nil when they are concurrent as they are.
  # @param unfixed [Proc, nil] for a fix made in the block itself: the calls
  #   without it, which the blocking probe runs (and, with no fix needed on
  #   this Ruby, the test itself) instead of the block.
  # @param children [Boolean] each call runs the child process of
  #   #child_argv: the children must all have run at once.
  # @param note [String, Proc, nil] what the page says below the row's table
  #   on this Ruby, e.g. why its concurrent calls take two delays, not one;
  #   a Proc is called after the calls (it may ask what they did) and may
  #   return nil.
  # @return [Array] the calls' values, in index order.
  def assert_concurrent_calls(row, gem: nil, fix: nil, unfixed: nil, children: false, note: nil, &call)
    raise ArgumentError, "unknown fix #{fix.inspect}" if fix && !FIXES.key?(fix)
    raise ArgumentError, "a row with children needs no fix (its probe would have no rendezvous)" if children && fix
    plain = unfixed || call
    return probe_blocking(&plain) if ENV["NEVERBLOCK_COMPAT_PROBE"]

    probe = fix && blocking_probe_in_child(FIXES.fetch(fix)[:holds_loop])
    @rendezvous = ChildRendezvous.new(CALLS) if children
    values, seconds, stood_still = run_calls(CALLS, fix: fix, &(fix ? call : plain))
    note = note.call if note.respond_to?(:call)
    record_row(row, gem: gem, fix: fix, seconds: seconds, probe: probe, note: note)
    if children
      assert @rendezvous.all_together?,
             "#{row}: the #{CALLS} children did not all run at once (each waits until all have started; " \
             "\"alone\": it gave up): #{@rendezvous.verdicts}"
    else
      # On a loaded machine the calls can take longer together without waiting
      # one after the other: then the loop went on turning while they waited,
      # and they still took less than one after the other at the least would.
      assert seconds < CONCURRENT_LIMIT || (stood_still < DELAY * 0.6 && seconds < CALLS * DELAY),
             "#{row}: #{CALLS} calls of #{DELAY} s took #{seconds.round(2)} s, and the loop stood still for " \
             "#{stood_still.round(2)} s at a time: one after the other?"
    end
    values
  ensure
    @rendezvous&.close
    @rendezvous = nil
  end

  # The command of call `index` in a row with `children: true`: a child
  # that sleeps DELAY, then waits until all CALLS children have started.
  # @param options [Hash] ChildRendezvous#argv's exit_status: and output:.
  # @return [Array<String>] an argv.
  def child_argv(index, **options)
    raise ArgumentError, "child_argv is for rows with children: true" unless @rendezvous

    @rendezvous.argv(index, sleep: DELAY, **options)
  end

  # The server side shared by the rows: see CompatServers.
  include CompatServers

  private

  # @return [Array(Array, Float, Float)] the values, the wall time in
  #   seconds, and the longest the loop stood still meanwhile (a task
  #   ticking every 20 ms measures it).
  def run_calls(count, fix: nil, stall_threshold: nil, &call)
    require "neverblock/io_select" if fix == :io_select
    values = nil
    stood_still = 0.0
    options = stall_threshold ? { stall_threshold: stall_threshold } : {}
    seconds = elapsed do
      NeverBlock.run(**options) do
        ticker = NeverBlock.spawn do
          loop do
            before = now
            sleep 0.02
            stood_still = [stood_still, now - before - 0.02].max
          end
        end
        begin
          tasks = Array.new(count) do |index|
            NeverBlock.spawn { fix == :defer ? NeverBlock.defer { call.call(index) } : call.call(index) }
          end
          values = tasks.map(&:value)
        ensure
          ticker.cancel # a call that failed must fail the test, not leave the loop ticking forever
        end
      end
    end
    [values, seconds, stood_still]
  end

  # In the child: the calls as they are, two of them, with the stall detector
  # on; the wall time and what NeverBlock logged go to the file named by
  # NEVERBLOCK_COMPAT_PROBE.
  def probe_blocking(&call)
    seconds = nil
    log = capture_log { _, seconds = run_calls(PROBE_CALLS, stall_threshold: PROBE_STALL_THRESHOLD, &call) }
    File.write(ENV.fetch("NEVERBLOCK_COMPAT_PROBE"), JSON.generate("seconds" => seconds, "log" => log))
    skip "the blocking probe: the parent test reads its result" # the rest of the test is the parent's
  end

  # Runs this test alone in a child Ruby as #probe_blocking, and asserts what
  # a blocking row is: two calls one after the other, and (when the calls
  # hold the loop) a stall warning.
  # @return [Hash] "seconds" and "warning" (the first report, shortened; nil if none).
  def blocking_probe_in_child(holds_loop)
    file = method(name).source_location.first
    Dir.mktmpdir("neverblock-compat") do |dir|
      output = File.join(dir, "probe.json")
      _, err, status = ruby_child("-I#{File.expand_path('..', __dir__)}", file, "-n", "/\\A#{name}\\z/",
                                  env: { "NEVERBLOCK_COMPAT_PROBE" => output, "NEVERBLOCK_COMPAT_RESULTS" => nil },
                                  timeout: 60)
      assert status.success? && File.exist?(output), "the blocking probe failed:\n#{err}"
      probe = JSON.parse(File.read(output))
      assert_operator probe["seconds"], :>=, PROBE_SERIAL_AT_LEAST,
                      "#{PROBE_CALLS} plain calls ran at once in #{probe['seconds'].round(2)} s: this row needs no fix now"
      warned = probe["log"].include?("has held the event loop")
      assert_equal holds_loop, warned, "a stall warning for the plain calls expected: #{holds_loop}\n#{probe['log']}"
      { "seconds" => probe["seconds"], "warning" => (shorten_warning(probe["log"]) if warned) }
    end
  end

  # The first stall report: its summary and the top frames, with paths cut
  # to the gem ("excon-1.6.0/lib/...") or the repository ("test/...").
  def shorten_warning(log)
    report = log[/^W, .*?has held the event loop.*?(?=^[A-Z], |\z)/m] || log
    lines = report.lines.map(&:rstrip).reject(&:empty?)
    summary = lines.first.sub(/\AW, \[[^\]]*\]\s+WARN -- NeverBlock: /, "").sub(/#<NeverBlock::Task:0x\h+/, "#<NeverBlock::Task")
    summary = summary.sub(/ \((?:[^()]*\/)?(test\/[^()]*)\)>/, ' (\1)>')
    frames = lines.drop(1).first(4).map { |frame| "  #{short_path(frame.strip)}" }
    [summary, *frames].join("\n")
  end

  def short_path(frame)
    frame.sub(%r{\A.*/gems/}, "").sub(%r{\A.*/lib/ruby/(?:vendor_ruby/)?[\d.]+/}, "").sub(%r{\A(?:/src|#{Regexp.escape(ChildRuby::ROOT)})/}, "")
  end

  # Appends the row's result to NEVERBLOCK_COMPAT_RESULTS/ruby-VERSION.jsonl:
  # row, gem, version (the gem's, or "stdlib"), ruby (RUBY_VERSION, "+YJIT"
  # when on), verdict ("concurrent", or "needs fix"), seconds (the
  # CALLS calls, with the fix if any), fix, fix_text, probe_seconds and
  # warning (blocking rows), test, load (the machine's 1-minute load average
  # when the row ended, which the page shows beside the times; nil without
  # /proc), note.
  def record_row(row, gem:, fix:, seconds:, probe:, note:)
    dir = ENV.fetch("NEVERBLOCK_COMPAT_RESULTS", "")
    return if dir.empty?

    yjit = defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled?
    result = {
      "row" => row, "gem" => gem, "version" => gem ? Gem.loaded_specs.fetch(gem).version.to_s : "stdlib",
      "ruby" => "#{RUBY_VERSION}#{'+YJIT' if yjit}", "verdict" => fix ? "needs fix" : "concurrent",
      "seconds" => seconds.round(3), "fix" => fix&.to_s, "fix_text" => fix && FIXES.fetch(fix)[:text],
      "probe_seconds" => probe && probe["seconds"].round(3), "warning" => probe && probe["warning"],
      "test" => "#{self.class.name}##{name}", "load" => load_average, "note" => note
    }
    FileUtils.mkdir_p(dir)
    File.open(File.join(dir, "ruby-#{RUBY_VERSION}#{'-yjit' if yjit}.jsonl"), "a") do |file|
      file.flock(File::LOCK_EX)
      file.puts(JSON.generate(result))
    end
  end

  def load_average
    File.read("/proc/loadavg").split.first.to_f
  rescue SystemCallError
    nil
  end
end
