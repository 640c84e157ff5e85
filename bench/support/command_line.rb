# frozen_string_literal: true

require "optparse"

module NeverBlockBench
  # What the benchmark scripts' command lines share: the --only, --out and
  # --selector options, and how a run ends (usage on bad options, exit 1 when
  # a cell failed).
  module CommandLine
    module_function

    # Adds the shared options to `opts`, storing their values in `options`.
    # @param results [String] the result files' base name, e.g. "client"
    # @param variants [String] what --only accepts, e.g. "threads,async"
    def shared_options(opts, options, results:, variants:)
      opts.on("--only LIST", Array, "variants to run: #{variants}") { |list| options[:only] = list }
      opts.on("--out DIR", "where #{results}.csv and #{results}.svg go (bench/results)") do |value|
        options[:out] = value
      end
      opts.on("--selector NAME", "io-event selector for NeverBlock and async: epoll, uring, select (epoll)") do |value|
        options[:selector] = value
      end
    end

    # Parses ARGV with `parser`, runs the block (the benchmark; true when every
    # cell succeeded) and exits with its status.
    def run(parser)
      parser.parse!
      success = yield
      exit(success ? 0 : 1)
    rescue OptionParser::ParseError, ArgumentError => e
      abort "#{e.message}\n#{parser}"
    end

    # `path` relative to the current directory, for messages.
    def relative(path)
      path.delete_prefix("#{Dir.pwd}/")
    end
  end
end
