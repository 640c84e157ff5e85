# frozen_string_literal: true

require "etc"
require "open3"
require "tmpdir"

module NeverBlockBench
  # Runs pgbench, PostgreSQL's own benchmark client (C, libpq), on a custom
  # script: the reference a Ruby client's queries/s is measured against.
  #
  #   result = Pgbench.run("\\set x random(1, 1000)\nselect :x;\n", mode: "extended",
  #                        clients: 12, transactions: 10_000, env: PostgresServer.libpq_env)
  #   result.tps # => 36903.2
  module Pgbench
    # One pgbench run.
    # tps :: transactions per second, without the time to connect
    # latency_ms :: average transaction latency
    Result = Struct.new(:tps, :latency_ms, keyword_init: true)

    module_function

    # @return [String, nil] the pgbench executable: $PGBENCH, or the first
    #   `pgbench` on PATH; nil when there is none (e.g. in the Ruby 3.3 chroot)
    def executable
      given = ENV.fetch("PGBENCH", nil)
      return given if given && File.executable?(given)

      ENV.fetch("PATH", "").split(File::PATH_SEPARATOR).map { |dir| File.join(dir, "pgbench") }
         .find { |path| File.file?(path) && File.executable?(path) }
    end

    # @return [String, nil] e.g. "pgbench (PostgreSQL) 15.13"
    def version
      path = executable or return nil
      output, status = Open3.capture2e(path, "--version")
      status.success? ? output.strip : nil
    end

    # @param script [String] the custom script (pgbench -f)
    # @param mode [String] -M: "simple", "extended" or "prepared"
    # @param clients [Integer] -c; -j is as many threads, at most one per CPU
    # @param transactions [Integer] -t: per client
    # @param env [Hash{String => String}] libpq variables (PGHOST, ...)
    # @param timeout [Numeric] seconds before the run is abandoned
    # @return [Result]
    # @raise [RuntimeError] when pgbench fails or prints no tps
    def run(script, mode:, clients:, transactions:, env:, timeout: 120)
      path = executable or raise "no pgbench"
      Dir.mktmpdir("neverblock-pgbench") do |dir|
        file = File.join(dir, "script.sql")
        File.write(file, script)
        threads = [clients, Etc.nprocessors].min
        command = ["timeout", timeout.to_s, path, "--no-vacuum", "-f", file, "-M", mode, "-c", clients.to_s,
                   "-j", threads.to_s, "-t", transactions.to_s]
        output, status = Open3.capture2e(env, *command)
        raise "pgbench failed (#{status}): #{output.lines.last(3).join.strip}" unless status.success?

        parse(output)
      end
    end

    # @param output [String] what pgbench printed
    # @return [Result]
    def parse(output)
      tps = output[/^tps = ([\d.]+) \(without initial connection time\)/, 1] or
        raise "pgbench printed no tps: #{output.lines.last(3).join.strip}"
      Result.new(tps: Float(tps), latency_ms: output[/^latency average = ([\d.]+) ms/, 1]&.to_f)
    end
  end
end
