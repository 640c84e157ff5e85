# frozen_string_literal: true

require "optparse"
require_relative "../neverblock"

module NeverBlock
  # The `neverblock` command. Subcommands:
  #
  #   neverblock serve [config.ru]    serve a Rack app (see CLI::Serve)
  #   neverblock debounce --upstream URL   a coalescing reverse proxy (see CLI::Debounce)
  #   neverblock run FILE [ARGS...]   run a Ruby script inside NeverBlock.run
  #   neverblock -e CODE              run Ruby code inside NeverBlock.run
  #   neverblock version              print the version
  #   neverblock help                 this text
  #
  # Later subcommands (the server, the debouncer) register here too.
  class CLI
    USAGE = <<~TEXT
      Usage: neverblock COMMAND [options]

      Commands:
        serve [CONFIG_RU] [options]
                             serve a Rack app with NeverBlock::Server (see `neverblock serve --help`)
        debounce --upstream URL [options]
                             a reverse proxy that coalesces identical concurrent requests
                             (see `neverblock debounce --help`)
        ctl COMMAND [-C URL] talk to a running server's control listener: stats, tasks, metrics,
                             restart, phased-restart, stop, halt, gc (see `neverblock ctl --help`)
        run FILE [ARGS...]   run a Ruby script inside NeverBlock.run (blocking calls in it
                             suspend only their fiber; use NeverBlock.spawn for concurrency)
        -e CODE              run Ruby code inside NeverBlock.run
        version              print the NeverBlock version
        help                 show this help

      Environment:
        NEVERBLOCK_SELECTOR=epoll|uring|select   the io-event selector (default epoll)
        NEVERBLOCK_STALL_THRESHOLD=SECONDS|off   warn when a fiber holds the loop this long (0.1)
    TEXT

    # The file name of `neverblock -e CODE` in backtraces.
    EVAL_FILE = "(neverblock -e)"

    # Usage of each subcommand that takes no options of its own.
    SUBCOMMAND_USAGE = {
      "run" => "Usage: neverblock run FILE [ARGS...]\n\nRuns the Ruby script FILE inside NeverBlock.run, " \
               "with ARGV set to ARGS and $0 to FILE's full path.",
      "-e" => "Usage: neverblock -e CODE [ARGS...]\n\nRuns CODE inside NeverBlock.run, with ARGV set to ARGS.",
      "version" => "Usage: neverblock version\n\nPrints the NeverBlock version."
    }.freeze

    # @param out [IO] where output goes.
    # @param err [IO] where errors go.
    def initialize(out: $stdout, err: $stderr)
      @out = out
      @err = err
    end

    # Runs the command line.
    # @param argv [Array<String>]
    # @return [Integer] the exit status.
    def call(argv)
      argv = argv.dup
      command = argv.shift
      if SUBCOMMAND_USAGE.key?(command) && %w[-h --help].include?(argv.first)
        @out.puts(SUBCOMMAND_USAGE.fetch(command))
        return 0
      end
      case command
      when "serve"
        require_relative "cli/serve"
        Serve.new(out: @out, err: @err).call(argv)
      when "debounce"
        require_relative "cli/debounce"
        Debounce.new(out: @out, err: @err).call(argv)
      when "ctl"
        require_relative "cli/ctl"
        catch(:done) { Ctl.new(out: @out, err: @err).call(argv) }
      when "run" then run_file(argv)
      when "-e" then run_code(argv)
      when "version", "--version", "-v" then @out.puts("neverblock #{VERSION}") || 0
      when nil, "help", "--help", "-h" then @out.puts(USAGE) || 0
      else
        @err.puts("neverblock: unknown command #{command.inspect}\n\n#{USAGE}")
        64 # EX_USAGE
      end
    end

    private

    def run_file(argv)
      file = argv.shift
      return usage_error("run needs a FILE") unless file
      return usage_error("no such file: #{file}") unless File.file?(file)

      ARGV.replace(argv)
      path = File.expand_path(file)
      $PROGRAM_NAME = path # so that the script's `if __FILE__ == $0` holds
      NeverBlock.run { load(path) }
      0
    end

    def run_code(argv)
      code = argv.shift
      return usage_error("-e needs CODE") unless code

      ARGV.replace(argv)
      # Not "-e": error_highlight would take Ruby's own -e script for it (on
      # Ruby 3.1 the exception's message is then lost).
      NeverBlock.run { TOPLEVEL_BINDING.eval(code, EVAL_FILE) }
      0
    end

    def usage_error(message)
      @err.puts("neverblock: #{message}\n\n#{USAGE}")
      64
    end
  end
end
