# frozen_string_literal: true

# What every script under bench/ shares, loaded first (`require_relative
# "support/harness"`): the start-up (lib/ and the C extension on the load
# path, the bundle), the command line (the DEFAULTS, --only, --out,
# --quick), a fork per measurement, medians, the printed table, the CSV
# file and the header's facts about the machine. Charts are in svg_chart.rb.
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
# The C extensions (ext/neverblock/epoll, http_head), compiled for this Ruby if needed:
# on the load path here and, through RUBYLIB, of every `neverblock serve`
# a script starts (peers run under a bundle of their own, without it).
require_relative "../../bin/lib/compile_ext"
NeverBlockExtension.build.then do |ext|
  $LOAD_PATH.unshift(ext)
  ENV["RUBYLIB"] = [ext, ENV.fetch("RUBYLIB", nil)].compact.reject(&:empty?).join(File::PATH_SEPARATOR)
end
require "etc"
require "fileutils"
require "io/wait"
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

  # The result of repeated measurements: the middle one (the mean of the two
  # middle ones), nil for none.
  def self.median(values)
    sorted = values.sort
    (sorted[(sorted.size - 1) / 2] + sorted[sorted.size / 2]) / 2.0 unless sorted.empty?
  end

  # @return [String] every value, sorted, to show how far runs spread, e.g. "0.45 0.62 1.30"
  def self.listing(values, digits = 2) = values.sort.map { |value| format("%.#{digits}f", value) }.join(" ")

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
        result = outcome.is_a?(Isolated::Failure) ? "FAILED #{outcome}" : format("%.3f s", cell.runs.last)
        warn "  #{cell.name}, run #{round + 1}: #{result}"
      end
    end
    cells
  end

  # One cell of a table measured over several runs: each run's seconds, and
  # where measured its CPU seconds and allocations (every run's Hash in
  # `outcomes`); failures as text.
  Cell = Struct.new(:name, :fields, :runs, :cpu, :allocations, :outcomes, :failures, :skipped) do
    def initialize(name, skipped: nil, **fields)
      super(name, fields, [], [], [], [], [], skipped)
    end

    # A field given to new, else nil (members by their readers).
    def [](key) = fields[key]

    def record(outcome)
      return failures << outcome.to_s if outcome.is_a?(Isolated::Failure)

      outcome = { seconds: outcome } unless outcome.is_a?(Hash)
      outcomes << outcome
      runs << outcome[:seconds]
      cpu << outcome[:cpu] if outcome[:cpu]
      allocations << outcome[:allocations] if outcome[:allocations]
    end

    def median = NeverBlockBench.median(runs)
    def listing(digits = 2) = NeverBlockBench.listing(runs, digits)
  end

  # What a script's benchmark class inherits: the options {CommandLine.main}
  # parsed, in @options; its #call measures and reports.
  class Bench
    def initialize(options)
      @options = options
    end
  end

  # The scripts' command line: every DEFAULTS entry as an option, the shared
  # ones, quick mode, and how a run ends.
  module CommandLine
    SHARED = { out: RESULTS }.freeze

    module_function

    # A script's entry point: parses ARGV over the bench's DEFAULTS (and its
    # QUICK over those in quick mode), runs `bench.new(options).call` and
    # exits 0 when that returns true; usage on a bad option. Each DEFAULTS
    # entry is an option of its name: `pool_size: 12` is --pool-size N,
    # `delays: [0, 10]` --delays 0,10, `raise: true` --[no-]raise, `app: "/x"` --app VALUE.
    # @param bench [Class] with DEFAULTS, QUICK and ONLY (what --only accepts, in order)
    # @param name [String] the script's and its result files' base name, e.g. "client"
    def main(bench, name)
      $stdout.sync = true
      options = {}
      parser = OptionParser.new("Usage: bench/run #{name} [options]") do |opts|
        bench::DEFAULTS.each { |key, default| add(opts, options, key, default) }
        opts.on("--only LIST", Array, "only these, in this order: #{bench::ONLY.join(',')}") { |list| options[:only] = list }
        opts.on("--out DIR", "where #{name}.csv and #{name}.svg go (bench/results)") { |dir| options[:out] = dir }
        opts.on("--quick", "smoke run (also BENCH_QUICK=1): tiny durations, one round") { options[:quick] = true }
      end
      parser.parse!
      quick = options[:quick] || ENV["BENCH_QUICK"] == "1"
      options = SHARED.merge(bench::DEFAULTS, quick ? bench::QUICK.merge(quick: true) : {}, options)
      options[:only] = only(options[:only], bench::ONLY)
      exit(bench.new(options).call ? 0 : 1)
    rescue OptionParser::ParseError, ArgumentError => e
      abort "#{e.message}\n#{parser}"
    end

    # The option of one DEFAULTS entry, typed by its default (none for nil).
    def add(opts, options, key, default)
      flag = "--#{key.to_s.tr('_', '-')}"
      case default
      when true, false then opts.on(flag.sub("--", "--[no-]"), "(default: #{default})") { |value| options[key] = value }
      when Integer, Float then opts.on("#{flag} N", default.class, "(default: #{default})") { |value| options[key] = value }
      when String then opts.on("#{flag} VALUE", String, "(default: #{default})") { |value| options[key] = value }
      when Array
        opts.on("#{flag} LIST", Array, "(default: #{default.join(',')})") do |list|
          options[key] = default.first.is_a?(Integer) ? list.map { |value| Integer(value.delete("_")) } : list
        end
      end
    end

    # @return [Array<String>] the names --only gave, in the script's order; all of them without it
    def only(names, all)
      unknown = (names || all) - all
      raise OptionParser::InvalidArgument, "unknown #{unknown.join(', ')}; use #{all.join(',')}" unless unknown.empty?

      all & (names || all)
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
  # @param rows [Array<Hash>] by column (the columns: every key, in order of appearance)
  # @param chart [SvgChart, nil]
  def self.write_results(out, name, rows, chart = nil)
    puts "\nload average at end: #{Machine.load_average}"
    FileUtils.mkdir_p(out)
    headers = rows.flat_map(&:keys).uniq
    files = [CsvFile.write(File.join(out, "#{name}.csv"), headers, rows.map { |row| row.values_at(*headers) })]
    files << chart.write(File.join(out, "#{name}.svg"), rows) if chart
    puts "wrote #{files.map { |path| path.delete_prefix("#{Dir.pwd}/") }.join(' and ')}"
  end

  # A script's first lines: what it measures, the Ruby, `facts` (versions,
  # settings), the machine and its load.
  def self.header(title, *facts)
    [title, RUBY_DESCRIPTION, *facts, Machine.description, "load average at start: #{Machine.load_average}"].join("\n")
  end

  # A chart whose subtitle ends with the Ruby and the machine it was measured on.
  def self.chart(title, *subtitle)
    SvgChart.new(title: title, subtitle: [*subtitle, "ruby #{RUBY_VERSION}, #{Machine.description}"])
  end

  # A plain-text table with aligned columns: the first left, the rest right
  # unless `align` says otherwise; nil cells print empty.
  class Table
    def initialize(headers, rows = [], align: nil)
      @headers = headers.map(&:to_s)
      @align = align || [:left] + [:right] * (headers.size - 1)
      @rows = rows.map { |row| row.map(&:to_s) }
    end

    # @param rows [Array<Hash>] e.g. a script's CSV rows by header
    # @return [Table] the `columns` of `rows`
    def self.of(rows, columns)
      new(columns, rows.map { |row| row.values_at(*columns) })
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
      # The child writes once, as it ends: readable means its result, or its death.
      unless reader.wait_readable(timeout)
        Process.kill("KILL", pid)
        Process.wait(pid)
        return Failure.new("Timeout", "killed after #{timeout} s")
      end
      data = reader.read
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
    def raise_fd_limit(wanted)
      soft, hard = Process.getrlimit(:NOFILE)
      target = hard == Process::RLIM_INFINITY ? wanted : [wanted, hard].min
      Process.setrlimit(:NOFILE, target, hard) if target > soft
    end

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

    # Raises a kernel tunable to `value` when it is lower, as root (left
    # raised: a concurrent run may need it); elsewhere leaves it.
    def raise_sysctl(name, value)
      File.write("/proc/sys/#{name}", "#{value}\n") if Process.euid.zero? && sysctl(name).to_i < value
    rescue SystemCallError
      nil
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
    # NB_BENCH_CHECKOUT: the description bench/run made outside a chroot, where git can read the checkout.
    def self.description
      return ENV["NB_BENCH_CHECKOUT"] if ENV["NB_BENCH_CHECKOUT"]

      git = ["git", "-C", File.expand_path("../..", __dir__)]
      commit = IO.popen([*git, "rev-parse", "--short", "HEAD"], err: File::NULL, &:read).strip
      changed = !IO.popen([*git, "status", "--porcelain", "--", "lib"], err: File::NULL, &:read).strip.empty?
      commit.empty? ? "commit unknown (not a git checkout)" : "commit #{commit}#{' + uncommitted changes in lib/' if changed}"
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

  # NeverBlock and Async on the same io-event selector, EPoll. io-event's
  # default, which Async takes, is URing where liburing was there at build
  # time, while NeverBlock's is EPoll: {.use_epoll} sets both libraries'
  # variables before any cell is forked, and {.probe} checks in a child what each uses.
  module Peers
    # Versions and selector class names a child saw.
    Probe = Struct.new(:neverblock, :async, :io_event, :neverblock_selector, :async_selector, keyword_init: true)

    module_function

    # @return [String] the IO::Event::Selector constant name, "EPoll"
    def use_epoll
      ENV["NEVERBLOCK_SELECTOR"] = "epoll"
      ENV["IO_EVENT_SELECTOR"] = "EPoll"
    end

    # @return [Probe, Isolated::Failure]
    def probe
      Isolated.run(timeout: 60) do
        require "neverblock"
        require "async" # in both bench bundles
        short = ->(klass) { klass.is_a?(Module) ? klass.name.split("::").last : klass.to_s }
        # Async has no public reader for its selector; @selector has held it since async 2.0.
        Probe.new(neverblock: NeverBlock::VERSION, async: Async::VERSION, io_event: IO::Event::VERSION,
                  neverblock_selector: NeverBlock.run { short.call(Fiber.scheduler.selector_class) },
                  async_selector: Async { short.call(Fiber.scheduler.instance_variable_get(:@selector)&.class || "unknown") }.wait)
      end
    end

    # @return [String] e.g. "neverblock 0.1.0, async 2.23.1, io-event 1.11.2; selector EPoll for NeverBlock, EPoll for async"
    def text(probe)
      return "versions and selector unknown (probe failed: #{probe})" if probe.is_a?(Isolated::Failure)

      selectors = { "NeverBlock" => probe.neverblock_selector, "async" => probe.async_selector }.compact
      ["neverblock #{probe.neverblock}", ("async #{probe.async}" if probe.async), "io-event #{probe.io_event}"].compact.join(", ") +
        "; selector #{selectors.map { |library, name| "#{name} for #{library}" }.join(', ')}"
    end

    # The start-up of a script comparing event loops: sets the selector,
    # probes, prints the header the block returns (given the probe, so that
    # it can name the versions).
    # @return [Probe, nil] nil, after a warning, when a library is not on EPoll
    def start
      use_epoll
      probe = self.probe
      puts yield(probe)
      return probe if !probe.is_a?(Isolated::Failure) && [probe.neverblock_selector, probe.async_selector].compact.all?("EPoll")

      warn "NeverBlock and async are not both on the EPoll selector (see above); not measuring"
      nil
    end
  end
end
