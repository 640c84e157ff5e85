#!/usr/bin/env ruby
# frozen_string_literal: true

# What a fiber's wait for IO costs, with and without a timeout: CPU µs and
# objects allocated per wait, 100 tasks each ping-ponging a byte over a
# socket pair (write, wait readable, read), in a process of its own per
# cell (support/io_wait_child.rb), interleaved rounds, medians. A timed
# wait is what Net::HTTP's read_timeout, redis-client's, and NeverBlock's
# reverse proxy make on every read (mysql2's too, given a read_timeout). Runtimes:
# NeverBlock (this checkout), NeverBlock at --before (a git worktree of
# that revision, its lib/ under this checkout's bundle), async.
#
#   bench/run io_wait                       -> bench/results/io_wait.{txt,csv,svg}
#   bench/run --ruby 3.4-yjit io_wait       -> bench/results/ruby34-yjit/
#   bench/run io_wait --only neverblock,before --before 84701d1 --runs 7
#   bench/run io_wait --quick               smoke run

require_relative "support/harness"
require_relative "support/worktrees"
require "open3"

module NeverBlockBench
  class IOWaitBench < Bench
    include Worktrees

    DEFAULTS = { waits: 200_000, pairs: 100, runs: 5, timeout: 60.0, before: "84701d1" }.freeze
    QUICK = { waits: 20_000, runs: 1 }.freeze
    ONLY = %w[neverblock before async].freeze # the runtimes
    CHILD = File.expand_path("support/io_wait_child.rb", __dir__)
    COLUMNS = ["runtime", "commit", "wait", "CPU us/wait", "runs", "objects/wait", "timed extra us"].freeze

    # @return [Boolean] true when every cell was measured
    def call
      puts NeverBlockBench.header("A fiber's IO wait: CPU and allocations per wait, with and without a timeout",
                                  "#{@options[:pairs]} tasks, #{@options[:waits]} waits a cell (after as many unmeasured), " \
                                  "a timed wait given #{@options[:timeout]} s; #{@options[:runs]} interleaved rounds, medians")
      libs = @options[:only].to_h { |runtime| [runtime, lib(runtime)] }
      commits = libs.keys.to_h { |runtime| [runtime, commit(runtime)] }
      cells = libs.keys.product(%w[untimed timed])
      results = Hash.new { |hash, key| hash[key] = [] }
      @options[:runs].times do
        cells.each { |runtime, wait| results[[runtime, wait]] << measure(runtime, libs[runtime], wait) }
      end
      rows = cells.map { |runtime, wait| row(runtime, commits[runtime], wait, results[[runtime, wait]]) }
      rows.each do |row|
        untimed = rows.find { |other| other["runtime"] == row["runtime"] && other["wait"] == "untimed" }
        next unless row["wait"] == "timed" && row["CPU us/wait"] && untimed["CPU us/wait"]

        row["timed extra us"] = (row["CPU us/wait"] - untimed["CPU us/wait"]).round(2)
      end
      puts "\n#{Table.of(rows, COLUMNS)}"
      chart = NeverBlockBench.chart("A fiber's IO wait", "#{@options[:pairs]} tasks ping-ponging a byte; medians")
      chart.pivot("CPU per wait, µs (lower is better)", "CPU us/wait", series: "runtime", by: "wait")
      NeverBlockBench.write_results(@options[:out], "io_wait", rows, chart)
      rows.all? { |row| row["CPU us/wait"] }
    end

    private

    # @return [String, nil] the lib/ a NeverBlock runtime loads (nil: async, from the bundle)
    def lib(runtime)
      case runtime
      when "neverblock" then File.join(REPO, "lib")
      when "before" then File.join(checkout(@options[:before]), "lib")
      end
    end

    # @return [Array(Float, Float), nil] CPU µs and objects per wait of one cell, nil if it failed
    def measure(runtime, lib, wait)
      command = [RbConfig.ruby, *(["-I", lib] if lib), CHILD, runtime == "async" ? "async" : "neverblock",
                 wait == "timed" ? @options[:timeout].to_s : "none", @options[:waits].to_s, @options[:pairs].to_s]
      output, status = Open3.capture2e(*command)
      unless status.success?
        warn "  #{runtime} #{wait} failed: #{output.lines.last(3).join.strip}"
        return nil
      end
      cpu, objects = output.lines.last.split.map { |value| Float(value) }
      warn format("  %-10s %-7s %.3f µs, %.2f objects a wait", runtime, wait, cpu, objects)
      [cpu, objects]
    end

    # @return [String] which code a runtime is: this checkout's commit, --before, async's version
    def commit(runtime)
      case runtime
      when "neverblock" then Checkout.description.delete_prefix("commit ")
      when "before" then @options[:before]
      else "async #{Machine.gem_version('async')}"
      end
    end

    def row(runtime, commit, wait, runs)
      done = runs.compact
      { "runtime" => runtime, "commit" => commit, "wait" => wait,
        "CPU us/wait" => (NeverBlockBench.median(done.map(&:first)).round(3) unless done.empty?),
        "runs" => NeverBlockBench.listing(done.map(&:first), 3),
        "objects/wait" => (NeverBlockBench.median(done.map(&:last)).round(2) unless done.empty?) }
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::IOWaitBench, "io_wait") if $PROGRAM_NAME == __FILE__
