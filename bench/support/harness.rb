# frozen_string_literal: true

# What every script under bench/ shares, loaded first (`require_relative
# "support/harness"`): the start-up (lib/ on the load path, the bundle), the
# command line (--only, --out, --selector, --quick), a fork per measurement,
# medians, the printed table, the CSV file and the header's facts about the
# machine. Charts are in svg_chart.rb.
#
# Quick mode (--quick, or BENCH_QUICK=1 in the environment) is a smoke run:
# each script shrinks its durations and counts to seconds and one round, so
# that it can be checked end to end on a busy machine. Its numbers mean nothing.

$LOAD_PATH.unshift(File.expand_path("../../lib", __dir__))
begin
  require "bundler/setup"
rescue LoadError, StandardError => e
  warn "bundler/setup failed (#{e.message.lines.first&.strip}); using installed gems"
end
require "etc"
require "fileutils"
require "io/wait"
require "open3"
require "optparse"
require_relative "svg_chart"

module NeverBlockBench
  RESULTS = File.expand_path("../results", __dir__)

  # Seconds on the monotonic clock.
  def self.now
    Process.clock_gettime(Process::CLOCK_MONOTONIC)
  end

  # @return [Float] seconds the block took
  def self.timed
    started = now
    yield
    now - started
  end

  # @return [Hash] :seconds of wall time, :cpu seconds this process used
  #   (user + system, all its threads) and Ruby :allocations meanwhile
  def self.timed_with_cpu(&block)
    before = Process.times
    allocated = GC.stat(:total_allocated_objects)
    seconds = timed(&block)
    after = Process.times
    { seconds: seconds, cpu: (after.utime - before.utime) + (after.stime - before.stime),
      allocations: GC.stat(:total_allocated_objects) - allocated }
  end

  # @return [Array<Integer>] `total` split into `parts` non-zero shares that differ by at most 1
  def self.split(total, parts)
    Array.new(parts) { |i| (total / parts) + (i < total % parts ? 1 : 0) }.reject(&:zero?)
  end

  # Measures every cell `rounds` times, interleaved (round 1 of every cell,
  # then round 2, ...), so that a slow minute of a shared machine spreads
  # over all cells instead of landing on one. Each measurement is the
  # block's value, in a forked child ({Isolated}).
  # @param cells [Array<Cell>]
  # @yieldparam cell [Cell]
  # @yieldreturn [Numeric, Hash] seconds, or a Hash with :seconds (and :cpu, :allocations)
  def self.rounds(cells, rounds, timeout: 120, &measure)
    rounds.times do |round|
      cells.each do |cell|
        next if cell.skipped

        outcome = Isolated.run(timeout: timeout.respond_to?(:call) ? timeout.call(cell) : timeout) { measure.call(cell) }
        cell.record(outcome)
        warn "  #{cell.name}, run #{round + 1}: #{cell.outcome_text(outcome)}"
      end
    end
    cells
  end

  # One cell of a table measured over several runs: each run's seconds, and
  # where measured its CPU seconds and allocations; failures as text.
  Cell = Struct.new(:name, :fields, :runs, :cpu, :allocations, :failures, :skipped) do
    def initialize(name, skipped: nil, **fields)
      super(name, fields, [], [], [], [], skipped)
    end

    # A field given to new, else nil (members by their readers).
    def [](key) = fields[key]

    def record(outcome)
      return failures << outcome.to_s if outcome.is_a?(Isolated::Failure)

      outcome = { seconds: outcome } unless outcome.is_a?(Hash)
      runs << outcome[:seconds]
      cpu << outcome[:cpu] if outcome[:cpu]
      allocations << outcome[:allocations] if outcome[:allocations]
    end

    def outcome_text(outcome)
      return "FAILED #{outcome}" if outcome.is_a?(Isolated::Failure)

      format("%.3f s", outcome.is_a?(Hash) ? outcome[:seconds] : outcome)
    end

    def median = Samples.new(runs).median
    def samples = Samples.new(runs)
    # @return [Float, nil] median of `per` (cpu or allocations) divided by `count`
    def median_per(per, count) = Samples.new(per).median&./(count)
  end

  # The scripts' command line: the shared options, quick mode, and how a run ends.
  module CommandLine
    module_function

    # Adds --only, --out, --selector and --quick to `opts`, storing into `options`.
    # @param results [String] the result files' base name, e.g. "client"
    # @param variants [String] what --only accepts, e.g. "threads,async"
    def shared_options(opts, options, results:, variants:)
      opts.on("--only LIST", Array, "variants to run: #{variants}") { |list| options[:only] = list }
      opts.on("--out DIR", "where #{results}.csv and #{results}.svg go (bench/results)") { |dir| options[:out] = dir }
      opts.on("--selector NAME", "io-event selector for NeverBlock and async: epoll, uring, select (epoll)") do |name|
        options[:selector] = name
      end
      opts.on("--quick", "smoke run (also BENCH_QUICK=1): tiny durations, one round") { options[:quick] = true }
    end

    # Parses ARGV with `parser` (quick mode from the environment too), runs the
    # block with the options (the benchmark; true when every cell succeeded)
    # and exits with its status; usage on a bad option.
    # @param defaults [Hash] the full-length run's options
    # @param quick [Hash] what quick mode overrides in them
    def run(parser, options = {}, defaults: {}, quick: {})
      parser.parse!
      quick_run = options[:quick] || ENV["BENCH_QUICK"] == "1"
      options = defaults.merge(quick_run ? quick.merge(quick: true) : {}).merge(options)
      exit(yield(options) ? 0 : 1)
    rescue OptionParser::ParseError, ArgumentError => e
      abort "#{e.message}\n#{parser}"
    end

    # A script's entry point: its options (the block adds its own to `opts`,
    # storing into `options`), the shared ones, then `bench.new(options).call`
    # with its DEFAULTS and QUICK; exits 0 when that returns true.
    # @param bench [Class] e.g. ClientBench
    # @param name [String] the script's and its result files' base name, e.g. "client"
    # @yieldparam opts [OptionParser]
    # @yieldparam options [Hash]
    def main(bench, name, variants:)
      $stdout.sync = true
      options = {}
      parser = OptionParser.new do |opts|
        opts.banner = "Usage: ruby bench/#{name}.rb [options]"
        yield opts, options
        shared_options(opts, options, results: name, variants: variants)
      end
      run(parser, options, defaults: bench::DEFAULTS, quick: bench::QUICK) { |opts| bench.new(opts).call }
    end

    # "2,4,1_000" split by OptionParser's Array => [2, 4, 1000]
    def integers(list) = list.map { |value| Integer(value.delete("_")) }

    # The parts of a script that --only names (all without it), in the script's order.
    def parts(only, all)
      unknown = (only || all) - all
      raise OptionParser::InvalidArgument, "unknown part(s) #{unknown.join(', ')}; use #{all.join(',')}" unless unknown.empty?

      all & (only || all)
    end

    # The entries of `all` (each with #name) that --only names; all without it.
    def select(all, only)
      return all unless only

      unknown = only - all.map(&:name)
      raise OptionParser::InvalidArgument, "unknown variant(s) #{unknown.join(', ')}" unless unknown.empty?

      all.select { |item| only.include?(item.name) }
    end

    # `path` relative to the current directory, for messages.
    def relative(path)
      path.delete_prefix("#{Dir.pwd}/")
    end
  end

  # Writes a CSV file (RFC 4180 quoting) without the csv gem, which is not a
  # default gem on every Ruby the benchmarks run on. nil cells are empty.
  module CsvFile
    def self.write(path, headers, rows)
      cell = ->(value) { value.to_s.match?(/[",\n]/) ? "\"#{value.to_s.gsub('"', '""')}\"" : value.to_s }
      File.write(path, ([headers] + rows).map { |row| row.map(&cell).join(",") }.join("\n") + "\n")
      path
    end
  end

  # Writes a script's CSV and SVG into `out` and prints the "wrote" line
  # bench/run looks for before it keeps the printed tables.
  # @param chart [SvgChart, nil]
  def self.write_results(out, name, headers, rows, chart = nil)
    FileUtils.mkdir_p(out)
    files = [CsvFile.write(File.join(out, "#{name}.csv"), headers, rows)]
    files << chart.write(File.join(out, "#{name}.svg")) if chart
    puts "\nwrote #{files.map { |path| CommandLine.relative(path) }.join(' and ')}"
  end

  # A plain-text table with aligned columns: the first left, the rest right
  # unless `align` says otherwise; nil cells print empty.
  class Table
    def initialize(headers, align: nil)
      @headers = headers.map(&:to_s)
      @align = align || [:left] + [:right] * (headers.size - 1)
      @rows = []
    end

    def <<(row)
      @rows << row.map(&:to_s)
      self
    end

    def to_s
      all = [@headers] + @rows
      widths = @headers.each_index.map { |i| all.map { |row| row[i].to_s.size }.max }
      line = lambda do |cells|
        cells.each_with_index.map { |cell, i| @align[i] == :right ? cell.to_s.rjust(widths[i]) : cell.to_s.ljust(widths[i]) }
             .join("  ").rstrip
      end
      ([line.call(@headers), widths.map { |width| "-" * width }.join("  ")] + @rows.map(&line)).map { |text| "#{text}\n" }.join
    end
  end

  # Repeated measurements of one cell: the median is the result, the sorted
  # values beside it show how far the runs spread.
  class Samples
    attr_reader :values

    def initialize(values)
      @values = values.map(&:to_f)
    end

    # @return [Float, nil] the middle value (mean of the two middle ones)
    def median
      return nil if @values.empty?

      sorted = @values.sort
      (sorted[(sorted.size - 1) / 2] + sorted[sorted.size / 2]) / 2.0
    end

    def min = @values.min
    def max = @values.max
    def empty? = @values.empty?

    # @return [String] every value, sorted, e.g. "0.45 0.62 1.30"
    def to_s(digits: 2)
      @values.sort.map { |value| format("%.#{digits}f", value) }.join(" ")
    end
  end

  # Runs a block in a forked child and returns its value, so one measurement
  # cannot disturb the next: each starts from the same heap, its threads and
  # fibers and peak RSS are its own, and a crash or hang costs one cell.
  module Isolated
    # What a failed, dead or timed-out child reports instead of a value.
    Failure = Struct.new(:error_class, :message) do
      def to_s = "#{error_class}: #{message}"
    end

    # @param timeout [Float] seconds before the child is killed
    # @yieldreturn [Object] a value Marshal can dump
    # @return [Object, Failure]
    def self.run(timeout:)
      reader, writer = IO.pipe
      pid = fork do
        reader.close
        result = begin
          yield
        rescue Exception => e # rubocop:disable Lint/RescueException -- reported to the parent
          Failure.new(e.class.name, e.message.lines.first.to_s.strip)
        end
        writer.write(Marshal.dump(result))
        writer.close
        exit!(0) # not the parent's at_exit handlers
      end
      writer.close
      data = +"".b
      deadline = NeverBlockBench.now + timeout
      until (chunk = reader.read_nonblock(65_536, exception: false)).nil?
        if chunk == :wait_readable
          next if reader.wait_readable([deadline - NeverBlockBench.now, 0].max)

          Process.kill("KILL", pid)
          Process.wait(pid)
          return Failure.new("Timeout", "killed after #{timeout} s")
        end
        data << chunk
      end
      _, status = Process.wait2(pid)
      return Marshal.load(data) unless data.empty? # rubocop:disable Security/MarshalLoad -- our own child

      Failure.new("Died", status.signaled? ? "killed by signal #{status.termsig}" : "exit status #{status.exitstatus}")
    ensure
      reader&.close
      writer&.close unless writer&.closed?
    end
  end

  # Facts about this machine and process, for headers and memory measurements
  # (Linux /proc; "unknown" or nil elsewhere).
  module Machine
    module_function

    # Raises the soft RLIMIT_NOFILE towards `wanted` (never above the hard limit).
    # @return [Integer] the soft limit now in force
    def raise_fd_limit(wanted)
      soft, hard = Process.getrlimit(:NOFILE)
      target = hard == Process::RLIM_INFINITY ? wanted : [wanted, hard].min
      Process.setrlimit(:NOFILE, target, hard) if target > soft
      Process.getrlimit(:NOFILE).first
    end

    def ruby_description = RUBY_DESCRIPTION

    # @return [String] e.g. "2 CPUs, Intel(R) Xeon(R) Processor, Linux 6.1.0, 23.5 GiB RAM"
    def description
      cpu = (File.read("/proc/cpuinfo")[/^model name\s*:\s*(.+)$/, 1]&.squeeze(" ") rescue nil) || "unknown CPU"
      memory = (File.read("/proc/meminfo")[/^MemTotal:\s+(\d+)/, 1] rescue nil)
      ["#{Etc.nprocessors} CPUs", cpu, "#{Etc.uname[:sysname]} #{Etc.uname[:release]}",
       (format("%.1f GiB RAM", memory.to_i / 1024.0 / 1024.0) if memory)].compact.join(", ")
    end

    # @param field [String] a /proc/self/status field, e.g. "VmRSS", "VmHWM"
    # @return [Integer, nil] kB
    def status_kb(field)
      File.read("/proc/self/status")[/^#{field}:\s+(\d+)\s+kB/, 1]&.to_i
    rescue SystemCallError
      nil
    end

    # Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0).
    def reset_peak_rss
      File.write("/proc/self/clear_refs", "5")
    rescue SystemCallError
      nil
    end

    # @param name [String] a kernel tunable, e.g. "kernel/pid_max"
    # @return [Integer, nil]
    def sysctl(name)
      Integer(File.read("/proc/sys/#{name}").split.first)
    rescue SystemCallError, ArgumentError, TypeError
      nil
    end

    # Raises a kernel tunable to `target` when it is below `minimum` (as root;
    # left raised, since a concurrent run may need it).
    # @return [Array(Symbol, Integer, Object)] [:ok, current, nil],
    #   [:raised, old, new], [:failed, current, reason] or [:unknown, nil, nil]
    def raise_sysctl(name, minimum:, target: minimum)
      current = sysctl(name)
      return [:unknown, nil, nil] if current.nil?
      return [:ok, current, nil] if current >= minimum
      return [:failed, current, "not root"] unless Process.euid.zero?

      File.write("/proc/sys/#{name}", "#{[target, minimum].max}\n")
      now = sysctl(name)
      now && now >= minimum ? [:raised, current, now] : [:failed, current, "the kernel kept #{now}"]
    rescue SystemCallError => e
      [:failed, current, "#{e.class.name.split('::').last}: #{e.message}"]
    end

    # @return [String] the 1, 5 and 15 minute load averages
    def load_average
      File.read("/proc/loadavg").split.first(3).join(" ")
    rescue SystemCallError
      "unknown"
    end

    # @return [String, nil] the version of gem `name` that is (or would be) loaded
    def gem_version(name)
      Gem.loaded_specs[name]&.version&.to_s || Gem::Specification.find_by_name(name).version.to_s
    rescue Gem::MissingSpecError, LoadError
      nil
    end
  end

  # Which NeverBlock was measured: the commit, and whether lib/ had changes.
  module Checkout
    def self.description
      repo = File.expand_path("../..", __dir__)
      commit, ok = Open3.capture2("git", "-C", repo, "rev-parse", "--short", "HEAD")
      return "commit unknown (not a git checkout)" unless ok.success?

      changes, = Open3.capture2("git", "-C", repo, "status", "--porcelain", "--", "lib")
      "commit #{commit.strip}#{changes.strip.empty? ? '' : ' + uncommitted changes in lib/'}"
    rescue SystemCallError
      "commit unknown (no git)"
    end
  end

  # Keeps the CPUs from going idle while a block runs: a busy loop at nice 19
  # on every CPU but one. On a VM, waking a halted vCPU can take tens of µs,
  # which a client waiting for every reply pays twice per round trip (on the
  # VM of bench/results, pgbench -c 1: 10-14k tps idle, 57-62k kept awake).
  module Spinner
    def self.awake(count: [Etc.nprocessors - 1, 1].max)
      parent = Process.pid
      pids = Array.new(count) do
        fork do
          Process.setpriority(Process::PRIO_PROCESS, 0, 19)
          10_000.times {} while Process.ppid == parent # rubocop:disable Lint/EmptyBlock -- until orphaned or killed
          exit!(0)
        end
      end
      yield
    ensure
      pids&.each do |pid|
        Process.kill("KILL", pid)
        Process.wait(pid)
      rescue Errno::ESRCH, Errno::ECHILD
        nil
      end
    end
  end

  # NeverBlock and Async on the same io-event selector. io-event's default,
  # which Async takes, is URing where liburing was there at build time, while
  # NeverBlock's is EPoll: {.use_selector} sets both libraries' variables
  # before any cell is forked, and {.probe} checks in a child what each uses.
  module Peers
    SELECTORS = { "epoll" => "EPoll", "uring" => "URing", "select" => "Select" }.freeze
    DEFAULT_SELECTOR = "epoll"
    # Versions and selector class names a child saw; async's are nil when not installed.
    Probe = Struct.new(:neverblock, :async, :io_event, :neverblock_selector, :async_selector, keyword_init: true)

    module_function

    # @param name [String] "epoll", "uring" or "select"
    # @return [String] the IO::Event::Selector constant name, e.g. "EPoll"
    def use_selector(name)
      constant = SELECTORS.fetch(name.to_s.strip.downcase) do
        raise ArgumentError, "unknown selector #{name.inspect}; use one of: #{SELECTORS.keys.join(', ')}"
      end
      ENV["NEVERBLOCK_SELECTOR"] = name.to_s.strip.downcase
      ENV["IO_EVENT_SELECTOR"] = constant
    end

    # @return [Probe, Isolated::Failure]
    def probe
      Isolated.run(timeout: 60) do
        require "neverblock"
        require "io/event"
        short = ->(klass) { klass.is_a?(Module) ? klass.name.split("::").last : klass.to_s }
        probe = Probe.new(neverblock: NeverBlock::VERSION, io_event: IO::Event::VERSION,
                          neverblock_selector: NeverBlock.run { short.call(Fiber.scheduler.selector_class) })
        begin
          require "async"
        rescue LoadError
          next probe
        end
        probe.async = Async::VERSION
        # Async has no public reader for its selector; @selector has held it since async 2.0.
        probe.async_selector = Async { short.call(Fiber.scheduler.instance_variable_get(:@selector)&.class || "unknown") }.wait
        probe
      end
    end

    # @return [String] e.g. "neverblock 0.1.0, async 2.23.1, io-event 1.11.2"
    def versions_text(probe)
      return "versions unknown (probe failed: #{probe})" if probe.is_a?(Isolated::Failure)

      ["neverblock #{probe.neverblock}", ("async #{probe.async}" if probe.async), "io-event #{probe.io_event}"]
        .compact.join(", ")
    end

    # @return [String] which selector each library was seen to use
    def selector_text(probe, wanted)
      variables = "IO_EVENT_SELECTOR=#{ENV.fetch('IO_EVENT_SELECTOR', nil)}, " \
                  "NEVERBLOCK_SELECTOR=#{ENV.fetch('NEVERBLOCK_SELECTOR', nil)}"
      return "io-event selector: #{wanted} asked for (#{variables}); not checked, the probe failed" if probe.is_a?(Isolated::Failure)

      used = { "NeverBlock" => probe.neverblock_selector }
      used["async"] = probe.async_selector if probe.async
      return "io-event selector: #{wanted} for #{used.size == 1 ? 'NeverBlock' : 'both NeverBlock and async'} (#{variables})" if used.values.all?(wanted)

      "io-event selector: MISMATCH, #{used.map { |lib, name| "#{lib} #{name}" }.join(', ')}; #{wanted} was asked for (#{variables})"
    end

    # @return [Boolean] whether every loaded library uses the wanted selector
    def selector_matches?(probe, wanted)
      !probe.is_a?(Isolated::Failure) && [probe.neverblock_selector, probe.async_selector].compact.all?(wanted)
    end

    # The start-up of a script comparing event loops: sets the selector,
    # probes, prints `header` (a block, so it can name the probe's versions).
    # @return [Probe, nil] nil, after a warning, when the selectors differ
    def start(selector)
      wanted = use_selector(selector)
      probe = self.probe
      puts yield(probe, wanted)
      return probe if selector_matches?(probe, wanted)

      warn "NeverBlock and async are not on the same selector (see above); not measuring"
      nil
    end
  end
end
