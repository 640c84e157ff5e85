# frozen_string_literal: true

# The fuzzer's supervisor (bin/fuzz runs it; see there for the sanitizer
# setup): starts one worker process per target (test/fuzz/worker.rb), and
# with --libfuzzer the libFuzzer harness (LibFuzzer), all at once, for the
# time budget, and judges them. A worker fails when it exits non-zero (a
# sanitizer report, a broken invariant, an unexpected exception), overruns
# its budget by HANG_GRACE (a case that never ends), or when any process
# left a sanitizer report in the log directory. For each failure of a Ruby
# worker the input of the case being run is written to
# OUT/crash-<target>-<seed>-<case>.bin, with what else made the case and
# the command that replays it in a .txt beside it; libFuzzer writes its own
# (OUT/libfuzzer-crash-*, -timeout-*, ...).
#
#   ruby test/fuzz/run.rb --seconds 60 [--seed N] [--target NAME]... [--case N] [--out DIR]
#                         [--libfuzzer HARNESS]
#
# Exit status: 0 when every worker passed, 1 otherwise.
require "fileutils"
require "json"
require "optparse"
require "rbconfig"
require_relative "libfuzzer"
require_relative "recorder"
require_relative "targets"

module NeverBlockFuzz
  class Run
    # Seconds past its budget after which a worker is taken for hung.
    HANG_GRACE = 60
    # What in a sanitizer's log is a report, not a warning (ASan warns,
    # harmlessly, when Ruby switches a fiber's stack under it).
    REPORT = /ERROR: (?:AddressSanitizer|LeakSanitizer|UndefinedBehaviorSanitizer)|runtime error:|AddressSanitizer: CHECK failed/

    def initialize(argv)
      @seconds = 60
      @seed = Random.new_seed % 1_000_000_000
      @targets = []
      @case = nil
      @out = File.expand_path("../../tmp/fuzz", __dir__)
      OptionParser.new do |options|
        options.on("--seconds N", Float) { |value| @seconds = value }
        options.on("--seed N", Integer) { |value| @seed = value }
        options.on("--target NAME", [*Targets::NAMES.keys, "libfuzzer"]) { |value| @targets << value }
        options.on("--case N", Integer) { |value| @case = value }
        options.on("--out DIR") { |value| @out = File.expand_path(value) }
        options.on("--libfuzzer HARNESS") { |value| @libfuzzer = File.expand_path(value) }
      end.parse!(argv)
      @libfuzzer &&= LibFuzzer.new(@libfuzzer, @out)
      @targets = [*Targets::NAMES.keys, *("libfuzzer" if @libfuzzer)] if @targets.empty?
      raise OptionParser::InvalidOption, "--target libfuzzer needs --libfuzzer HARNESS" if @targets.include?("libfuzzer") && !@libfuzzer
      raise OptionParser::InvalidOption, "--case replays one Ruby target's case: give one --target" if @case && (@targets.size != 1 || @targets == ["libfuzzer"])
    end

    # @return [Integer] the exit status.
    def run
      @logs = File.join(@out, "sanitizer")
      FileUtils.mkdir_p(@logs)
      Dir[File.join(@logs, "*")].each { |path| File.delete(path) }
      what = @case ? "case #{@case}" : "#{@seconds.round} s"
      puts "==> fuzzing #{@targets.join(', ')} for #{what}, seed #{@seed} (bin/fuzz --seed #{@seed} reruns it)"
      workers = @targets.map { |target| start(target) }
      @judged = []
      failures = workers.map { |worker| finish(worker) }.compact
      stray = reports - @judged # a process a worker started
      failures << "sanitizer reports in #{stray.join(', ')}" unless stray.empty?
      if failures.empty?
        puts "==> fuzzing passed (seed #{@seed})"
        0
      else
        warn "==> fuzzing FAILED (seed #{@seed}):"
        failures.each { |failure| warn "  #{failure}" }
        1
      end
    end

    private

    def start(target)
      state = File.join(@out, "state-#{target}")
      out = File.join(@out, "worker-#{target}.out")
      err = File.join(@out, "worker-#{target}.err")
      if target == "libfuzzer"
        # Not under gcc's runtimes: the harness has clang's ASan built in.
        env = { "LD_PRELOAD" => nil }
        command = @libfuzzer.command(@seconds, @seed)
      else
        env = {}
        command = [RbConfig.ruby, File.join(__dir__, "worker.rb"), target, @seed.to_s, @seconds.to_s, state, @case&.to_s].compact
      end
      pid = Process.spawn(env, *command, out: out, err: err, pgroup: true)
      { target: target, pid: pid, state: state, out: out, err: err, deadline: now + @seconds + HANG_GRACE }
    end

    # Waits for a worker; prints its summary, or its failure with the input.
    # @return [String, nil] the failure in a line.
    def finish(worker)
      status = wait(worker)
      found = reports(worker[:pid])
      @judged.concat(found)
      if status&.success? && found.empty?
        summary(worker)
        return nil
      end

      why = status.nil? ? "hung (still running #{HANG_GRACE} s past its time)" : "exited #{status.exitstatus || "on signal #{status.termsig}"}"
      log = File.read(worker[:err])
      if worker[:target] == "libfuzzer"
        where = "input #{@libfuzzer.artifact(log) || 'not written'} (replay: bin/fuzz --replay FILE)"
      else
        number, data, parameters = Recorder.read(worker[:state])
        where = "case #{number}, input #{keep_input(worker[:target], number, data, parameters, why)}"
      end
      warn "==> #{worker[:target]}: #{why}; #{where}"
      warn log.lines.last(80).join
      found.each { |path| warn File.read(path) }
      "#{worker[:target]}: #{why}; #{where}"
    end

    # @return [Process::Status, nil] nil when it hung (it is killed).
    def wait(worker)
      loop do
        _, status = Process.wait2(worker[:pid], Process::WNOHANG)
        return status if status

        if now > worker[:deadline]
          Process.kill(:KILL, -worker[:pid])
          Process.wait(worker[:pid])
          return nil
        end
        sleep 0.1
      end
    end

    def summary(worker)
      return puts("==> libfuzzer (http_head): #{@libfuzzer.summary(File.read(worker[:err]))}") if worker[:target] == "libfuzzer"

      report = JSON.parse(File.read(worker[:out]).lines.last)
      counts = report["counts"].map { |key, value| "#{key} #{value}" }.join(", ")
      leak = report["leak"] && format("; leak check: %+d bytes, %+d descriptors after %d runs",
                                      report["leak"]["bytes"] || 0, report["leak"]["descriptors"], report["leak"]["runs"])
      puts "==> #{worker[:target]}: #{report['cases']} cases in #{report['seconds']} s#{leak}"
      puts "    #{counts}"
    end

    # Writes the case's input and a description; returns the input's path.
    def keep_input(target, number, data, parameters, why)
      base = File.join(@out, "crash-#{target}-#{@seed}-#{number}")
      File.binwrite("#{base}.bin", data || "")
      File.write("#{base}.txt", <<~TEXT)
        #{target} #{why} in case #{number} of seed #{@seed}
        replay: bin/fuzz --target #{target} --seed #{@seed} --case #{number}
        input (#{data&.bytesize || 0} bytes, also in #{File.basename(base)}.bin): #{data.inspect}
        parameters: #{parameters.inspect}
      TEXT
      "#{base}.bin"
    end

    # Sanitizer logs (ASAN_OPTIONS / UBSAN_OPTIONS log_path: one file per
    # process, named by its pid) that hold a report.
    # @param pid [Integer, nil] only that process's (nil: every process's).
    # @return [Array<String>] their paths.
    def reports(pid = nil)
      Dir[File.join(@logs, pid ? "*.#{pid}" : "*")].select { |path| File.read(path).match?(REPORT) }
    end

    def now
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end

exit NeverBlockFuzz::Run.new(ARGV).run if $PROGRAM_NAME == __FILE__
