# frozen_string_literal: true

require "optparse"
require "json"
require_relative "ctl/exchange"
require_relative "ctl/task_report"

module NeverBlock
  class CLI
    # `neverblock ctl COMMAND`: talks to a master's control listener
    # (`neverblock serve --control URL`, {NeverBlock::Server::Cluster::Control}),
    # as `pumactl` does to Puma's control app.
    class Ctl
      # Command => [HTTP method, path].
      COMMANDS = { "stats" => %w[GET /stats], "tasks" => %w[GET /tasks], "metrics" => %w[GET /metrics],
                   "restart" => %w[POST /restart], "phased-restart" => %w[POST /phased-restart],
                   "stop" => %w[POST /stop], "halt" => %w[POST /halt], "gc" => %w[POST /gc],
                   "refork" => %w[POST /refork] }.freeze

      # Seconds the master has to answer unless `--timeout` says.
      DEFAULT_TIMEOUT = 30

      USAGE = <<~TEXT
        Usage: neverblock ctl COMMAND [-C URL] [-T TOKEN] [--timeout SECONDS]

        Talks to the control listener of a running `neverblock serve --control URL`.
        Exits 0 when the master answered 200, 1 when it answered otherwise, did not
        answer within the timeout or could not be reached, 64 on a usage error.
        Commands: #{COMMANDS.keys.join(', ')}
          stats            the master's and every worker's state, as JSON
          tasks            every worker's tasks by kind (requests in flight, children,
                           detached) with where each comes from and its backtrace, as text
          metrics          the cluster's metrics in Prometheus's text format
          phased-restart   replace the workers one at a time (as USR2)
          restart          a hot restart: the master executes itself again (as HUP)
          stop             stop gracefully (as TERM); halt: kill every worker now
          gc               a full GC in every worker
          refork           fork the next generation from a warmed-up worker (as URG; Linux)

      TEXT

      # @param out [IO]
      # @param err [IO]
      def initialize(out:, err:)
        @out = out
        @err = err
        @url = ENV["NEVERBLOCK_CONTROL_URL"]
        @token = ENV["NEVERBLOCK_CONTROL_TOKEN"]
        @timeout = DEFAULT_TIMEOUT
      end

      # @param argv [Array<String>]
      # @return [Integer] the exit status.
      def call(argv)
        rest = parser.parse(argv)
        command = rest.first
        return usage_error("which command? (#{COMMANDS.keys.join(', ')})") unless command
        return usage_error("unknown command #{command.inspect}") unless COMMANDS.key?(command)
        return usage_error("where is the control listener? -C tcp://127.0.0.1:9293 (or NEVERBLOCK_CONTROL_URL)") unless @url

        method, path = COMMANDS.fetch(command)
        status, body = Exchange.new(@url, @timeout).request(method, path, @token)
        (status == 200 ? @out : @err).puts(status == 200 && command == "tasks" ? TaskReport.render(body) : pretty(body))
        status == 200 ? 0 : 1
      rescue OptionParser::ParseError => e
        usage_error(e.message)
      rescue Exchange::Unanswered => e
        @err.puts("neverblock ctl: #{e.message}")
        1
      rescue SystemCallError, IOError, SocketError => e
        @err.puts("neverblock ctl: cannot reach #{@url}: #{e.message}")
        1
      end

      private

      def parser
        OptionParser.new do |o|
          o.banner = USAGE
          o.on("-C", "--control URL", "tcp://HOST:PORT or unix://PATH (default $NEVERBLOCK_CONTROL_URL)") { |url| @url = url }
          o.on("-T", "--token TOKEN", "the control token (default $NEVERBLOCK_CONTROL_TOKEN)") { |token| @token = token }
          o.on("-t", "--timeout SECONDS", Float,
               "give up when the master has not answered within SECONDS (default #{DEFAULT_TIMEOUT})") do |seconds|
            raise OptionParser::InvalidArgument, "#{seconds} (seconds, above 0)" unless seconds.positive?

            @timeout = seconds
          end
          o.on("-h", "--help", "this help") do
            @out.puts(o)
            throw :done, 0
          end
        end
      end

      def pretty(body)
        JSON.pretty_generate(JSON.parse(body))
      rescue JSON::ParserError
        body
      end

      def usage_error(message)
        @err.puts("neverblock ctl: #{message}\n\n#{USAGE}")
        64
      end
    end
  end
end
