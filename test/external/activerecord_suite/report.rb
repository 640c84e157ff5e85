# frozen_string_literal: true

# Compares the runs of bin/activerecord-suite test by test: prints a table
# (runs, passes, failures, errors, skips per mode), every test whose outcome
# differs from the stock adapter's under the same conditions (see
# baseline_for), and writes the same to <out>/activerecord_suite.txt and a
# summary to <out>/activerecord_suite.csv.
#
#   ruby report.rb --out DIR [--meta "KEY=VALUE"]... --run MODE=RESULTS.jsonl=SECONDS=STATUS...
#
# Exit status: 0 when every run finished and no outcome differs from its
# baseline's other than for a test in ALLOWED; 1 otherwise.

require "json"
require "optparse"
require "fileutils"
require_relative "../../../bench/support/harness" # its Table and CsvFile

module ARSuiteReport
  # Tests whose outcome may differ under a neverblock adapter because they
  # assert the adapter's name or class, not what it does. Test name => why.
  ALLOWED = {
    "ActiveRecord::AdapterTest#test_inspect_does_not_show_secrets" =>
      "matches the connection's #inspect against /ActiveRecord::ConnectionAdapters::\\w+:0x/, and the class " \
      "is NeverBlock::ActiveRecord::PostgreSQLAdapter",
    "ActiveRecord::ConnectionAdapters::PoolConfig::ResolverTest#test_url_invalid_adapter" =>
      "expects the exact list of registered adapter names in the error message, which has " \
      "neverblock_mysql2, neverblock_postgresql and neverblock_trilogy too"
  }.freeze

  # One mode's results.
  Run = Struct.new(:mode, :path, :seconds, :status, :results, :finished, keyword_init: true) do
    # @return [Hash{String => Integer}] runs, and one count per outcome
    def counts
      tally = results.values.map { |result| result["outcome"] }.tally
      { "runs" => results.size, "pass" => 0, "fail" => 0, "error" => 0, "skip" => 0 }.merge(tally)
    end
  end

  module_function

  # @return [Run]
  def load(spec)
    mode, path, seconds, status = spec.split("=", 4)
    results = {}
    finished = false
    if File.exist?(path)
      File.foreach(path) do |line|
        record = JSON.parse(line)
        if record["finished"]
          finished = true
        else
          results[record["test"]] = record
        end
      end
    end
    Run.new(mode: mode, path: path, seconds: Integer(seconds), status: Integer(status), results: results,
            finished: finished)
  end

  # "pass", "error: SystemStackError: ...", "not run"
  def describe(result)
    return "not run" unless result
    return result["outcome"] unless result["message"] && result["outcome"] != "pass"

    "#{result['outcome']}: #{result['message']}"
  end

  def location(result)
    result && result["location"].to_s.sub(%r{\A.*?/activerecord/(?=test/)}, "")
  end

  # @return [Array<Array(String, Hash, Hash)>] test, baseline result, this run's result
  def differences(baseline, run)
    (baseline.results.keys | run.results.keys).sort.filter_map do |test|
      before = baseline.results[test]
      after = run.results[test]
      next if before && after && before["outcome"] == after["outcome"]

      [test, before, after]
    end
  end

  # The run a mode is compared with: the stock adapter's run with the same
  # flags (neverblock_postgresql+fibers against postgresql+fibers, so that
  # both ran their tests inside NeverBlock.run), else the first run.
  def baseline_for(run, runs)
    stock = run.mode.sub(/\Aneverblock_/, "").sub("+neverblock", "")
    runs.find { |other| other.mode == stock } || runs.first
  end

  # For information, not counted: what running each test inside
  # NeverBlock.run changes with the stock adapter (postgresql+fibers against
  # postgresql), i.e. the effect of the fiber and the scheduler on the
  # suite itself, whatever the adapter.
  def harness_notes(runs)
    first = runs.first
    notes = +""
    runs.drop(1).each do |run|
      next if run.mode.start_with?("neverblock_") || !baseline_for(run, runs).equal?(run)

      diffs = differences(first, run)
      notes << "\n#{run.mode} against #{first.mode} (for information, not counted: the same adapter, " \
               "so these are the harness's): #{diffs.size} outcome#{diffs.size == 1 ? '' : 's'} differ" \
               "#{diffs.empty? ? '' : ':'}\n"
      diffs.each do |test, before, after|
        notes << "  #{test} (#{location(before || after)})\n" \
                 "    #{first.mode}: #{describe(before)}\n" \
                 "    #{run.mode}: #{describe(after)}\n"
      end
    end
    notes
  end

  def report(meta, runs, out)
    baseline = runs.first
    text = +""
    text << "ActiveRecord's own PostgreSQL test suite, adapter by adapter (bin/activerecord-suite)\n\n"
    meta.each { |key, value| text << "#{key}: #{value}\n" }
    text << "\n"

    table = NeverBlockBench::Table.new(%w[mode runs passes failures errors skips compared_with differing allowlisted
                                          seconds finished])
    csv_rows = []
    unexpected = 0
    details = +""
    runs.each do |run|
      against = baseline_for(run, runs)
      compared = !against.equal?(run)
      diffs = compared ? differences(against, run) : []
      allowed, other = diffs.partition { |test, _, _| ALLOWED.key?(test) }
      unexpected += other.size
      unexpected += 1 unless run.finished
      counts = run.counts
      row = [run.mode, counts["runs"], counts["pass"], counts["fail"], counts["error"], counts["skip"],
             compared ? against.mode : "-", compared ? other.size : "-", compared ? allowed.size : "-",
             run.seconds, run.finished ? "yes" : "NO (exit #{run.status})"]
      table << row
      csv_rows << [meta["Ruby"], meta["ActiveRecord"], meta["seed"], *row]
      next unless compared

      details << "\n#{run.mode}: #{other.size} outcome#{other.size == 1 ? ' differs' : 's differ'} from #{against.mode}'s" \
                 "#{other.empty? ? '' : ':'}\n"
      other.each do |test, before, after|
        details << "  #{test} (#{location(before || after)})\n" \
                   "    #{against.mode}: #{describe(before)}\n" \
                   "    #{run.mode}: #{describe(after)}\n"
      end
      unless allowed.empty?
        details << "  allowlisted (#{allowed.size}):\n"
        allowed.each do |test, before, after|
          details << "    #{test}: #{describe(before)} -> #{describe(after)} (#{ALLOWED[test]})\n"
        end
      end
    end
    text << table.to_s << details
    text << harness_notes(runs)

    failing = baseline.results.values.select { |result| %w[fail error].include?(result["outcome"]) }
    text << "\nNot passing under #{baseline.mode} (#{failing.size}):\n"
    failing.sort_by { |result| result["test"] }.each do |result|
      text << "  #{result['test']} (#{location(result)}): #{describe(result)}\n"
    end

    FileUtils.mkdir_p(out)
    txt = File.join(out, "activerecord_suite.txt")
    csv = File.join(out, "activerecord_suite.csv")
    File.write(txt, text)
    NeverBlockBench::CsvFile.write(csv, %w[ruby activerecord seed mode runs passes failures errors skips
                                           compared_with differing allowlisted seconds finished], csv_rows)
    puts text
    puts "wrote #{txt} and #{csv}"
    unexpected.zero?
  end
end

if $PROGRAM_NAME == __FILE__
  out = nil
  meta = {}
  specs = []
  OptionParser.new do |opts|
    opts.on("--out DIR") { |dir| out = dir }
    opts.on("--meta KEY=VALUE") do |pair|
      key, value = pair.split("=", 2)
      meta[key] = meta.key?(key) ? "#{meta[key]}; #{value}" : value
    end
    opts.on("--run MODE=RESULTS=SECONDS=STATUS") { |spec| specs << spec }
  end.parse!
  abort "report.rb: --out and at least two --run are needed" if out.nil? || specs.size < 2

  exit(ARSuiteReport.report(meta, specs.map { |spec| ARSuiteReport.load(spec) }, out) ? 0 : 1)
end
