# frozen_string_literal: true

# What every script under bench/ loads first: lib/, the C extensions, the
# bundle, the command line, a fork per measurement, the table, CSV and header.

$LOAD_PATH.unshift(File.expand_path("../../lib", __dir__))
begin
  require "bundler/setup"
rescue LoadError, StandardError => e
  warn "bundler/setup failed (#{e.message.lines.first&.strip}); using installed gems"
end
# The C extensions, built for this Ruby if needed: on the load path here and,
# through RUBYLIB, of every `neverblock serve` a script starts.
require_relative "../../bin/lib/compile_ext"
NeverBlockExtension.build.then do |ext|
  $LOAD_PATH.unshift(ext)
  ENV["RUBYLIB"] = [ext, ENV.fetch("RUBYLIB", nil)].compact.reject(&:empty?).join(File::PATH_SEPARATOR)
end
require "etc"
require "fileutils"
require "io/wait"
require "optparse"
require "tmpdir"
require_relative "svg_chart"

module NeverBlockBench
  RESULTS = File.expand_path("../results", __dir__)

  # Seconds on the monotonic clock.
  def self.now = Process.clock_gettime(Process::CLOCK_MONOTONIC)

  # @return [Float] seconds the block took
  def self.timed
    started = now
    yield
    now - started
  end

  # @return [Hash] :seconds of wall time, :cpu seconds of this process (user + system) and Ruby :allocations
  def self.timed_with_cpu(&block)
    before = Process.times
    allocated = GC.stat(:total_allocated_objects)
    seconds = timed(&block)
    after = Process.times
    { seconds: seconds, cpu: (after.utime - before.utime) + (after.stime - before.stime),
      allocations: GC.stat(:total_allocated_objects) - allocated }
  end

  # The middle value (the mean of the two middle ones); nil for none.
  def self.median(values)
    sorted = values.sort
    (sorted[(sorted.size - 1) / 2] + sorted[sorted.size / 2]) / 2.0 unless sorted.empty?
  end

  # The median of `key` over the Hashes `runs` that have it; nil for none.
  def self.median_of(runs, key) = median(runs.filter_map { |run| run[key] })

  # The value a `fraction` (0.99) of the way up the sorted values; nil for none.
  def self.percentile(values, fraction)
    sorted = values.sort
    sorted[((sorted.size - 1) * fraction).round] unless sorted.empty?
  end

  # @return [String] every value, sorted, e.g. "0.45 0.62 1.30"
  def self.listing(values, digits = 2) = values.sort.map { |value| format("%.#{digits}f", value) }.join(" ")

  # @return [Array<Integer>] `total` split into `parts` non-zero shares that differ by at most 1
  def self.split(total, parts)
    Array.new(parts) { |i| (total / parts) + (i < total % parts ? 1 : 0) }.reject(&:zero?)
  end

  # Measures every cell `rounds` times, interleaved (a slow minute of a shared
  # machine spreads over all cells), each in a forked child ({Isolated}).
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

  # One cell of a table measured over several runs: each run's seconds, CPU
  # seconds and allocations where measured (each run's Hash in `outcomes`),
  # failures as text; `cell[:key]` reads the fields given to new.
  Cell = Struct.new(:name, :fields, :runs, :cpu, :allocations, :outcomes, :failures, :skipped) do
    def initialize(name, skipped: nil, **fields)
      super(name, fields, [], [], [], [], [], skipped)
    end

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

  # A script's benchmark class: the parsed options in @options; #call measures and reports.
  class Bench
    def initialize(options)
      @options = options
    end

    # A temporary directory for this run's files, removed when the script ends.
    def scratch = @scratch ||= Dir.mktmpdir("neverblock-bench-")

    # @return [String] the path of a new file `name` (in `dir`) holding `text`, e.g. a server's config
    def config_file(name, text, dir: scratch) = File.join(dir, name).tap { |path| File.write(path, "#{text}\n") }

    def cleanup
      FileUtils.rm_rf(@scratch) if @scratch
    end
  end

  # The scripts' command line. Quick mode (--quick, BENCH_QUICK=1) is a smoke run whose numbers mean nothing.
  module CommandLine
    SHARED = { out: RESULTS }.freeze

    module_function

    # Parses ARGV over the bench's DEFAULTS (and QUICK over those in quick
    # mode), runs `bench.new(options).call`, exits 0 when that is true, then
    # stops every server still running. A DEFAULTS entry is an option of its
    # name: `pool_size: 12` --pool-size N, `delays: [0, 10]` --delays 0,10,
    # `raise: true` --[no-]raise, `app: "/x"` --app VALUE; ONLY lists what
    # --only accepts, in order; `name` is the result files' base name.
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
      runner = bench.new(options)
      exit(runner.call ? 0 : 1)
    rescue OptionParser::ParseError, ArgumentError => e
      abort "#{e.message}\n#{parser}"
    ensure
      ServerProcess.stop_all if defined?(ServerProcess)
      runner&.cleanup
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

    # @return [Array<String>] the names given, in the script's order; all of them for nil
    def only(names, all)
      unknown = (names || all) - all
      raise OptionParser::InvalidArgument, "unknown #{unknown.join(', ')}; use #{all.join(',')}" unless unknown.empty?

      all & (names || all)
    end
  end

  # A CSV file (RFC 4180 quoting) without the csv gem, not a default gem on every Ruby here.
  module CsvFile
    def self.write(path, headers, rows)
      cell = ->(value) { value.to_s.match?(/[",\n]/) ? "\"#{value.to_s.gsub('"', '""')}\"" : value.to_s }
      File.write(path, ([headers] + rows).map { |row| row.map(&cell).join(",") }.join("\n") + "\n")
      path
    end
  end

  # Writes a script's CSV (columns: every key of `rows`, in order) and SVG (of `chart_rows`) into
  # `out`, then the "wrote" line bench/run looks for before it keeps the tables.
  def self.write_results(out, name, rows, chart = nil, chart_rows: rows)
    puts "\nload average at end: #{Machine.load_average}"
    FileUtils.mkdir_p(out)
    headers = rows.flat_map(&:keys).uniq
    files = [CsvFile.write(File.join(out, "#{name}.csv"), headers, rows.map { |row| row.values_at(*headers) })]
    files << chart.write(File.join(out, "#{name}.svg"), chart_rows) if chart
    puts "wrote #{files.map { |path| path.delete_prefix("#{Dir.pwd}/") }.join(' and ')}"
  end

  # A script's first lines: what it measures, the Ruby, `facts`, the machine and its load.
  def self.header(title, *facts)
    [title, RUBY_DESCRIPTION, *facts, Machine.description, "load average at start: #{Machine.load_average}"].join("\n")
  end

  # A chart whose subtitle ends with the Ruby and the machine.
  def self.chart(title, *subtitle)
    SvgChart.new(title: title, subtitle: [*subtitle, "ruby #{RUBY_VERSION}, #{Machine.description}"])
  end

  # A plain-text table with aligned columns: the first and those named in
  # `left` left-aligned, the rest right, unless `align` gives each; nil prints empty.
  class Table
    def initialize(headers, rows = [], align: nil, left: [])
      @headers = headers.map(&:to_s)
      @align = align || @headers.each_with_index.map { |name, i| i.zero? || left.include?(name) ? :left : :right }
      @rows = rows.map { |row| row.map(&:to_s) }
    end

    # @return [Table] the `columns` of `rows` (Hashes by column)
    def self.of(rows, columns, **options) = new(columns, rows.map { |row| row.values_at(*columns) }, **options)

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

  # Kills and reaps a child process, if it is still there.
  def self.kill(pid)
    Process.kill("KILL", pid)
    Process.wait(pid)
  rescue Errno::ESRCH, Errno::ECHILD
    nil
  end

  # Runs a block in a forked child, so that each measurement starts from the
  # same heap, has its own peak RSS, and a crash or hang costs one cell.
  module Isolated
    Failure = Struct.new(:error_class, :message) do
      def to_s = "#{error_class}: #{message}"
    end

    # @return [Object, Failure] the block's value (Marshal-able), or why the child failed, died or was killed after `timeout` s
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
        NeverBlockBench.kill(pid)
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

  # Facts about this machine and process, from Linux's /proc ("unknown" or nil elsewhere).
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

    # @return [Integer, nil] kB of a /proc/self/status field, e.g. "VmRSS", "VmHWM"
    def status_kb(field) = (File.read("/proc/self/status")[/^#{field}:\s+(\d+)\s+kB/, 1]&.to_i rescue nil)

    # Resets this process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0).
    def reset_peak_rss = (File.write("/proc/self/clear_refs", "5") rescue nil)

    # @return [Integer, nil] a kernel tunable, e.g. "kernel/pid_max"
    def sysctl(name) = (Integer(File.read("/proc/sys/#{name}").split.first) rescue nil)

    # Raises a kernel tunable to `value` when lower, as root; left raised (a concurrent run may need it).
    def raise_sysctl(name, value)
      File.write("/proc/sys/#{name}", "#{value}\n") if Process.euid.zero? && sysctl(name).to_i < value
    rescue SystemCallError
      nil
    end

    # @return [String] the 1, 5 and 15 minute load averages
    def load_average = (File.read("/proc/loadavg").split.first(3).join(" ") rescue "unknown")

    # @return [String, nil] the version of gem `name` that is (or would be) loaded
    def gem_version(name)
      Gem.loaded_specs[name]&.version&.to_s || Gem::Specification.find_by_name(name).version.to_s
    rescue Gem::MissingSpecError, LoadError
      nil
    end
  end

  # Which NeverBlock was measured: the commit, and whether lib/ had changes
  # (NB_BENCH_CHECKOUT: bench/run's, made outside a chroot, where git can read the checkout).
  module Checkout
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

  # Keeps the CPUs from going idle while a block runs (a busy loop at nice 19 on every CPU but one): on a VM a client
  # waiting for every reply pays twice per round trip for waking a halted vCPU (pgbench -c 1: 10-14k tps, 57-62k awake).
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
      pids&.each { |pid| NeverBlockBench.kill(pid) }
    end
  end

  # NeverBlock and Async on the same io-event selector, EPoll (Async takes
  # io-event's default, URing where liburing was there at build time).
  module Peers
    Probe = Struct.new(:neverblock, :async, :io_event, :neverblock_selector, :async_selector, keyword_init: true)

    module_function

    # Sets both libraries' variables, before any cell is forked. @return [String] "EPoll"
    def use_epoll
      ENV["NEVERBLOCK_SELECTOR"] = "epoll"
      ENV["IO_EVENT_SELECTOR"] = "EPoll"
    end

    # @return [Probe, Isolated::Failure] what a child sees
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

      "neverblock #{probe.neverblock}, async #{probe.async}, io-event #{probe.io_event}; " \
        "selector #{probe.neverblock_selector} for NeverBlock, #{probe.async_selector} for async"
    end

    # Sets the selector, probes, prints the header the block makes of the probe; nil unless both are on EPoll.
    def start
      use_epoll
      probe = self.probe
      puts yield(probe)
      return probe if !probe.is_a?(Isolated::Failure) && [probe.neverblock_selector, probe.async_selector].all?("EPoll")

      warn "NeverBlock and async are not both on the EPoll selector (see above); not measuring"
      nil
    end
  end
end
