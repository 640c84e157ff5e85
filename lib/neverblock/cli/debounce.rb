# frozen_string_literal: true

require "optparse"
require "etc"
require_relative "../../neverblock"
require_relative "../server/errors"

module NeverBlock
  class CLI
    # `neverblock debounce --upstream URL [options]`: a reverse proxy on
    # {NeverBlock::Server} that coalesces identical concurrent requests
    # ({NeverBlock::Debouncer} in front of {NeverBlock::ReverseProxy}).
    class Debounce
      USAGE = <<~TEXT
        Usage: neverblock debounce --upstream http://HOST:PORT [options]

        A reverse proxy that lets one upstream call answer every identical concurrent
        request (GET and HEAD without credentials); everything else passes through.
        Upstream connections are kept alive and pooled.

      TEXT

      # @param out [IO]
      # @param err [IO]
      def initialize(out:, err:)
        @out = out
        @err = err
        @options = { listen: [], upstream: nil, ttl: 0.0, wait_timeout: 10.0, workers: Etc.nprocessors,
                     redis: nil, pool_size: 64, upstream_timeout: 30.0, access_log: false, status_path: nil,
                     share_credentials: false, max_shared_body: 8 * 1024 * 1024, max_body: 1024**3,
                     trust_forwarded: false }
      end

      # @param argv [Array<String>]
      # @return [Integer] the exit status.
      def call(argv)
        catch(:done) { parse_and_run(argv) }
      end

      private

      def parse_and_run(argv)
        rest = parser.parse(argv)
        return usage_error("unexpected arguments: #{rest.join(' ')}") unless rest.empty?
        return usage_error("--upstream is required") unless @options[:upstream]

        require_relative "../server"
        require_relative "../reverse_proxy"
        require_relative "../debouncer"
        NeverBlock::ReverseProxy.new(@options[:upstream]) # validates the URL before anything starts
        start
      rescue OptionParser::ParseError, ArgumentError => e
        usage_error(e.message)
      rescue LoadError => e
        @err.puts("neverblock debounce: #{e.message}")
        1
      rescue NeverBlock::Server::BootError, Errno::EADDRINUSE, Errno::EACCES, Errno::EADDRNOTAVAIL => e
        @err.puts("neverblock debounce: #{e.message}")
        1
      end

      def parser
        options = @options
        OptionParser.new do |o|
          o.banner = USAGE
          o.on("--upstream URL", "the origin to forward to: http://HOST:PORT[/PREFIX] (required)") { |url| options[:upstream] = url }
          o.on("-b", "--listen URL", "tcp://HOST:PORT or unix://PATH; repeatable (default tcp://0.0.0.0:9393)") do |url|
            options[:listen] << url
          end
          o.on("--ttl SECONDS", Float, "also answer identical requests from a stored response this long (default 0)") do |s|
            options[:ttl] = s
          end
          o.on("--wait-timeout SECONDS", Float, "longest a follower waits for the leader's answer, then 504 (default 10)") do |s|
            options[:wait_timeout] = s
          end
          o.on("-w", "--workers N", Integer, "worker processes; 0 = this process (default #{Etc.nprocessors})") do |n|
            options[:workers] = n
          end
          o.on("--redis URL", "elect one leader per key across processes and machines through Redis") do |url|
            options[:redis] = url
          end
          o.on("--share-credentials", "coalesce requests with Authorization/Cookie per credential (hashed)") do
            options[:share_credentials] = :per_credential
          end
          o.on("--trust-forwarded", "pass clients' Forwarded/X-Forwarded-* on (behind a front proxy that sets them)") do
            options[:trust_forwarded] = true
          end
          o.on("--max-body BYTES", Integer, "largest request body passed through; spooled to a temp file past " \
                                            "64 KiB (default 1 GiB, then 413)") { |n| options[:max_body] = n }
          o.on("--max-shared-body BYTES", Integer, "largest response shared with followers; larger ones stream " \
                                                   "to their own client (default 8 MiB)") do |n|
            options[:max_shared_body] = n
          end
          o.on("--pool-size N", Integer, "upstream connections per worker (default 64)") { |n| options[:pool_size] = n }
          o.on("--upstream-timeout SECONDS", Float, "longest wait for each upstream read or write (default 30)") do |s|
            options[:upstream_timeout] = s
          end
          o.on("--access-log", "log one line per request to stdout") { options[:access_log] = true }
          o.on("--status PATH", "answer GET PATH with the server's stats as JSON") { |path| options[:status_path] = path }
          o.on("-h", "--help", "this help") do
            @out.puts(o)
            throw :done, 0
          end
        end
      end

      def start
        opts = @options
        app = NeverBlock::Server::LazyApp.new { build_app }
        app.build if opts[:workers].zero?
        server_options = { bind: opts[:listen].empty? ? ["tcp://0.0.0.0:9393"] : opts[:listen], workers: opts[:workers],
                           status_path: opts[:status_path], max_body: opts[:max_body],
                           on_worker_boot: ->(_index) { app.build } }
        server_options[:access_log] = $stdout if opts[:access_log]
        server = NeverBlock::Server.new(app, **server_options)
        addresses = server.bound_addresses
        @out.puts("NeverBlock #{VERSION} debouncing #{opts[:upstream]} on #{addresses.join(', ')} " \
                  "(#{opts[:workers].zero? ? 'no workers' : NeverBlock::Server.workers_phrase(opts[:workers])}, " \
                  "#{opts[:redis] ? "shared through #{opts[:redis]}" : 'per process'}, pid #{Process.pid})")
        @out.flush
        server.run(handle_signals: true)
        0
      end

      # The app, built in each worker after fork: the upstream pool and the
      # Redis connections are the worker's own.
      def build_app
        opts = @options
        proxy = NeverBlock::ReverseProxy.new(opts[:upstream], pool_size: opts[:pool_size], timeout: opts[:upstream_timeout],
                                                              trust_forwarded: opts[:trust_forwarded])
        store = :memory
        if opts[:redis]
          require_relative "../debouncer/redis_store"
          store = NeverBlock::Debouncer::RedisStore.new(url: opts[:redis])
        end
        NeverBlock::Debouncer.new(proxy, ttl: opts[:ttl], wait_timeout: opts[:wait_timeout], store: store,
                                         share_credentials: opts[:share_credentials], max_body: opts[:max_shared_body])
      end

      def usage_error(message)
        @err.puts("neverblock debounce: #{message}\n\n#{parser}")
        64
      end
    end
  end
end
