# frozen_string_literal: true

require "optparse"
require "etc"
require_relative "../../neverblock"
require_relative "../server/errors"
require_relative "../server/concurrency_limit"
require_relative "../rails_integration"

module NeverBlock
  class CLI
    # `neverblock serve [config.ru] [options]`: runs a Rack app on
    # {NeverBlock::Server}. See {USAGE} or `neverblock serve --help`.
    class Serve
      USAGE = <<~TEXT
        Usage: neverblock serve [CONFIG_RU] [options]

        Serves the Rack app in CONFIG_RU (default ./config.ru) with NeverBlock::Server:
        every request in a fiber, one forked worker per CPU core by default.

      TEXT

      # @param out [IO]
      # @param err [IO]
      def initialize(out:, err:)
        @out = out
        @err = err
        @options = { bind: [], supervise: [], workers: Etc.nprocessors, preload: false, access_log: false,
                     shutdown_timeout: nil, fiber_pool: 1000, adaptive_limit: true, status_path: nil, environment: nil,
                     early_hints: false, opentelemetry: false, cancel_on_hangup: true, warmup: nil, limits: {} }
        @given = [] # options set on the command line, which win over a config file
      end

      # @param argv [Array<String>]
      # @return [Integer] the exit status.
      def call(argv)
        @argv = argv.dup # what a hot restart (HUP) executes again
        @started_in = Dir.pwd
        catch(:done) { parse_and_serve(argv) }
      end

      private

      def parse_and_serve(argv)
        rest = parser.parse(argv)
        return usage_error("one CONFIG_RU at most, got #{rest.join(' ')}") if rest.size > 1

        path = rest.first || "config.ru"
        return usage_error("no such file: #{path}") unless File.file?(path)

        apply_config_file(@options[:config]) if @options[:config]
        restart_with_fiber_stack(@options[:fiber_stack_size], argv) if @options[:fiber_stack_size]
        start(File.expand_path(path))
      rescue OptionParser::ParseError, ArgumentError => e
        usage_error(e.message)
      rescue LoadError => e
        @err.puts("neverblock serve: #{e.message}")
        1
      rescue NeverBlock::Server::BootError, Errno::EADDRINUSE, Errno::EACCES, Errno::EADDRNOTAVAIL => e
        @err.puts("neverblock serve: #{e.message}")
        1
      end

      # Records an option given on the command line.
      def set(key, value)
        @given << key
        @options[key] = value
      end

      def parser
        options = @options
        OptionParser.new do |o|
          o.banner = USAGE
          o.require_exact = true if o.respond_to?(:require_exact=) # `-p` is --port, never an abbreviation
          o.on("-b", "--bind URL", "tcp://HOST:PORT, unix://PATH or ssl://HOST:PORT?cert=PEM&key=PEM; " \
                                   "repeatable (default tcp://0.0.0.0:$PORT, else 9292)") do |url|
            options[:bind] << expand_tls_paths(url, Dir.pwd)
          end
          o.on("-p", "--port PORT", Integer, "the same as --bind tcp://0.0.0.0:PORT") do |port|
            options[:bind] << "tcp://0.0.0.0:#{port}"
          end
          o.on("-C", "--config FILE", "settings in Ruby (bind, workers, preload, limits, hooks...; " \
                                      "see NeverBlock::CLI::ConfigFile); the command line wins") do |file|
            options[:config] = File.expand_path(file)
          end
          o.on("-w", "--workers N", Integer, "worker processes; 0 = serve in this process (default #{Etc.nprocessors})") do |n|
            set(:workers, n)
          end
          o.on("--preload", "load the app once in the master, before forking (copy-on-write)") { set(:preload, true) }
          # Two switches, not --[no-]: require_exact refuses the --no- form on Ruby 3.1.
          o.on("--warmup", "Process.warmup (Ruby 3.3+: a full GC and compaction) where the app was loaded, " \
                           "before its first request (with --preload, in the master before forking; the default " \
                           "but in development)") do
            set(:warmup, true)
          end
          o.on("--no-warmup", "no Process.warmup once the app is loaded") { set(:warmup, false) }
          o.on("--access-log", "log one line per request to stdout") { set(:access_log, true) }
          o.on("--access-log-format FORMAT", %w[common json], "common (the default) or json: one object per line, " \
                                                              "with the request id") do |format|
            set(:access_log_format, format.to_sym)
          end
          o.on("--shutdown-timeout S", Float, "seconds in-flight requests get on TERM/INT (default 30)") do |seconds|
            set(:shutdown_timeout, seconds)
          end
          o.on("--request-timeout SECONDS", Float, "answer 503 to a request still waiting this long after its " \
                                                   "head, unwinding it at that wait (default: none)") do |seconds|
            set(:request_timeout, seconds)
          end
          o.on("--fiber-pool N", Integer, "requests served at once per worker (default 1000)") { |n| set(:fiber_pool, n) }
          # Two switches, not --[no-]: require_exact refuses the --no- form on Ruby 3.1.
          o.on("--adaptive-limit", "admit fewer than --fiber-pool requests at once while the event loop is " \
                                   "saturated, by its lag (the default)") { set(:adaptive_limit, true) }
          o.on("--no-adaptive-limit", "admit up to --fiber-pool requests at once whatever the load") do
            set(:adaptive_limit, false)
          end
          o.on("--early-hints", "give HTTP/1.1 requests env[\"rack.early_hints\"]: 103 Early Hints for " \
                                "Rails' preload links (default: off)") { set(:early_hints, true) }
          o.on("--no-early-hints", "no rack.early_hints (the default)") { set(:early_hints, false) }
          o.on("--no-cancel-on-hangup", "let a request whose client hung up run to its end (default: cancel it, " \
                                        "with its tasks and queries; logged 499)") { set(:cancel_on_hangup, false) }
          o.on("--opentelemetry", "a span per request, when the app loads OpenTelemetry (default: off)") { set(:opentelemetry, true) }
          o.on("--target-lag SECONDS", Float, "event-loop lag above which the adaptive limit falls " \
                                              "(default #{NeverBlock::Server::ConcurrencyLimit::DEFAULT_TARGET_LAG})") do |seconds|
            set(:adaptive_limit, { target_lag: seconds })
          end
          o.on("--max-connections N", Integer, "open connections per worker (default 16384 or the fd limit)") do |n|
            set(:max_connections, n)
          end
          o.on("--max-body BYTES", Integer, "largest request body, else 413; spooled to a temp file past 64 KiB " \
                                            "(default 10 MiB)") { |n| set(:max_body, n) }
          o.on("--worker-timeout SECONDS", Float, "kill and replace a worker whose event loop is held that long " \
                                                  "by one request (default 60)") { |seconds| set(:worker_timeout, seconds) }
          o.on("--max-requests N", Integer, "replace a worker after about N requests (plus up to a tenth), " \
                                            "its successor booted first") { |n| set(:max_requests, n) }
          o.on("--refork-after N,N", Array, "fork each next generation of workers from one that served N requests; " \
                                            "the last N repeats, unless false (Linux; also neverblock ctl refork)") do |counts|
            set(:refork_after, counts.map { |count| count == "false" ? false : Integer(count, 10) })
          rescue ArgumentError
            raise OptionParser::InvalidArgument, "--refork-after #{counts.join(',')} (request counts, like 100,1000)"
          end
          o.on("--max-memory BYTES", "replace a worker whose RSS passes BYTES (like 512M), its successor booted first") do |size|
            set(:max_memory, parse_size(size, "--max-memory"))
          end
          o.on("--supervise COMMAND", "keep COMMAND running beside the workers (like bin/jobs); repeatable. " \
                                      "SOLID_QUEUE_IN_PUMA set: bin/jobs") do |command|
            options[:supervise] << command
          end
          o.on("--control URL", "the master's control listener, tcp://127.0.0.1:9293 or unix://PATH: " \
                                "/metrics (Prometheus), /stats, /tasks and neverblock ctl") { |url| set(:control, url) }
          o.on("--control-token TOKEN", "the token a tcp:// control listener wants (default: made and logged)") do |token|
            set(:control_token, token)
          end
          o.on("--status PATH", "answer GET PATH with the server's stats as JSON") { |path| set(:status_path, path) }
          o.on("-E", "--env ENV", "RACK_ENV (and RAILS_ENV) for the app") { |env| set(:environment, env) }
          o.on("--log-level LEVEL", %w[debug info warn error fatal], "NeverBlock's own log: debug, info (the default, " \
                                                                      "or RAILS_LOG_LEVEL's), warn, error or fatal") do |level|
            set(:log_level, level)
          end
          o.on("--pidfile FILE", "write the master's pid there (removed on exit)") do |file|
            set(:pidfile, File.expand_path(file))
          end
          o.on("--log FILE", "append stdout and stderr (logs, access log) to FILE, line by line") do |file|
            set(:log, File.expand_path(file))
          end
          o.on("--fiber-stack-size BYTES", "stack of each request's fiber, like 4M (default: Ruby's, 128K of " \
                                           "Ruby frames); restarts the command with RUBY_FIBER_*_STACK_SIZE") do |size|
            set(:fiber_stack_size, parse_size(size, "--fiber-stack-size"))
          end
          o.on("-h", "--help", "this help") do
            @out.puts(o)
            throw :done, 0
          end
        end
      end

      # Takes what the file sets, except what the command line gave. A
      # setting the file gets wrong ends the command with its error (the
      # file and line) and where the settings are listed, not the whole
      # --help: the command line was right.
      def apply_config_file(file)
        raise ArgumentError, "no such config file: #{file}" unless File.file?(file)

        require_relative "config_file"
        begin
          config = ConfigFile.load(file)
          %i[fiber_stack_size max_memory].each do |key|
            config[key] = ConfigFile.bytes(config[key], key.to_s) if config[key].is_a?(String)
          end
        rescue ArgumentError => e
          message = e.message.start_with?(file) ? e.message : "#{file}: #{e.message}"
          throw :done, config_error(message)
        end
        binds = config.delete(:bind)&.map { |url| expand_tls_paths(url, File.dirname(file)) }
        @options[:supervise] = config.delete(:supervise) + @options[:supervise] if config.key?(:supervise)
        @options[:bind] = binds if binds && @options[:bind].empty?
        @options[:limits] = config.delete(:limits).merge(@options[:limits]) if config.key?(:limits)
        %i[pidfile log].each { |key| config[key] &&= File.expand_path(config[key], File.dirname(file)) }
        config.each { |key, value| @options[key] = value unless @given.include?(key) }
      end

      def expand_tls_paths(url, base)
        return url unless url.start_with?("ssl://")

        require_relative "../server/tls"
        NeverBlock::Server::TLS.expand_paths(url, base)
      end

      # @return [Integer] bytes, from `4194304`, `4096K`, `4M` (binary units).
      def parse_size(text, option)
        require_relative "config_file"
        ConfigFile.bytes(text, option)
      rescue ArgumentError => e
        raise OptionParser::InvalidArgument, e.message
      end

      # Ruby sizes fiber stacks once, at boot, from RUBY_FIBER_VM_STACK_SIZE
      # (Ruby frames) and RUBY_FIBER_MACHINE_STACK_SIZE (C frames): a running
      # process cannot change them. So the command starts again (exec, same
      # pid) with both set, unless they already are.
      def restart_with_fiber_stack(bytes, argv)
        return if RubyVM::DEFAULT_PARAMS[:fiber_vm_stack_size] >= bytes &&
                  RubyVM::DEFAULT_PARAMS[:fiber_machine_stack_size] >= bytes

        if ENV["NEVERBLOCK_FIBER_STACK_RESTARTED"]
          @err.puts("neverblock serve: this Ruby did not take the fiber stack size #{bytes} " \
                    "(#{RubyVM::DEFAULT_PARAMS.inspect}); serving with its own")
          return
        end

        env = { "RUBY_FIBER_VM_STACK_SIZE" => bytes.to_s, "RUBY_FIBER_MACHINE_STACK_SIZE" => bytes.to_s,
                "NEVERBLOCK_FIBER_STACK_RESTARTED" => "1" }
        @out.flush
        @err.flush
        exec(env, RbConfig.ruby, File.expand_path($PROGRAM_NAME), "serve", *argv)
      end

      def start(path)
        opts = @options
        redirect_output(opts[:log]) if opts[:log]
        # A server's output is its log (the access log, the app's logger on
        # $stdout): each line goes out as it is written, also into a pipe.
        $stdout.sync = true
        $stderr.sync = true
        NeverBlock.log_level = opts[:log_level] if opts[:log_level]
        if opts[:environment]
          ENV["RACK_ENV"] = opts[:environment]
          ENV["RAILS_ENV"] ||= opts[:environment]
        end
        Dir.chdir(File.dirname(path))
        opts[:supervise] = NeverBlock::RailsIntegration.supervise_solid_queue(opts[:supervise], @err, "neverblock serve")
        NeverBlock::RailsIntegration.default_rails_max_threads(@out)
        require_relative "../server"
        opts[:warmup] = NeverBlock::Server::HeapWarmup.wanted?(opts[:warmup]) # after RACK_ENV is set
        # Rack itself (not the app) loads once, in the master: a worker that
        # replaces a dead one then boots in ~10 ms instead of ~55.
        require "rack"
        require "rack/builder"
        loader = NeverBlock::Server::LazyApp.new { load_config(path) }
        if opts[:preload] || opts[:workers].zero?
          loader.build
          NeverBlock::Server::HeapWarmup.boot if opts[:warmup] && opts[:workers].zero? # a master: after before_fork (server_options)
        end
        # "serving" once the app answers (every worker accepts: on_booted), not
        # before a worker has loaded it, which may still fail.
        banner = nil
        options = server_options(loader)
        user_hook = options[:on_booted]
        options[:on_booted] = lambda do
          @out.puts(banner)
          @out.flush
          user_hook&.call
        end
        server = NeverBlock::Server.new(loader, **options)
        server.restart_command = [[RbConfig.ruby, File.expand_path($PROGRAM_NAME, @started_in), "serve", *@argv], @started_in]
        addresses = server.bound_addresses.join(", ")
        write_pidfile(opts[:pidfile]) if opts[:pidfile]
        who = "(#{opts[:workers].zero? ? 'no workers' : NeverBlock::Server.workers_phrase(opts[:workers])}, pid #{Process.pid})"
        banner = "NeverBlock #{VERSION} serving #{path} on #{addresses} #{who}"
        unless opts[:workers].zero?
          @out.puts("NeverBlock #{VERSION} listening on #{addresses} #{who}; the workers are booting")
          @out.flush
        end
        server.run(handle_signals: true)
        0
      ensure
        remove_pidfile(opts[:pidfile]) if opts && opts[:pidfile]
      end

      # stdout and stderr (the banner, NeverBlock's log, the access log)
      # appended to `file`, each line written as it comes.
      # The terminal gets one line saying where the rest goes.
      def redirect_output(file)
        @out.puts("NeverBlock #{NeverBlock::VERSION}: logging to #{file}")
        @out.flush
        $stdout.reopen(file, "a")
        $stderr.reopen($stdout)
        $stdout.sync = true
        $stderr.sync = true
      end

      def write_pidfile(file)
        File.write(file, "#{Process.pid}\n")
        @pidfile_owner = Process.pid
      end

      # Only the master that wrote it removes it (not a worker, not a
      # successor that wrote its own).
      def remove_pidfile(file)
        return unless @pidfile_owner == Process.pid && File.exist?(file) && File.read(file).to_i == Process.pid

        File.delete(file)
      rescue SystemCallError
        nil
      end

      # The app of a config.ru (rack 2's parse_file returned [app, options]).
      # A Rails app gets NeverBlock's Railtie though neverblock was loaded
      # before Rails (see RailsIntegration).
      def load_config(path)
        require "rack"
        require "rack/builder"
        require_relative "../rails_integration"
        app = NeverBlock::RailsIntegration.while_loading_app { Rack::Builder.parse_file(path) }
        app.is_a?(Array) ? app.first : app
      end

      # Without -b/-p or a bind in -C: the PORT variable's port, as Puma and
      # `rails server` take it (Thruster, Heroku and Foreman set it), else 9292.
      def default_bind
        port = ENV.fetch("PORT", "").strip
        return "tcp://0.0.0.0:9292" if port.empty?
        raise ArgumentError, "PORT=#{port} is not a port number" unless port.match?(/\A\d{1,5}\z/) && port.to_i.between?(1, 65_535)

        "tcp://0.0.0.0:#{port}"
      end

      def server_options(loader)
        opts = @options
        options = { bind: opts[:bind].empty? ? [default_bind] : opts[:bind], workers: opts[:workers],
                    fiber_pool: opts[:fiber_pool], adaptive_limit: opts[:adaptive_limit], status_path: opts[:status_path],
                    early_hints: opts[:early_hints], opentelemetry: opts[:opentelemetry],
                    cancel_on_hangup: opts[:cancel_on_hangup], **opts[:limits] }
        options[:access_log] = $stdout if opts[:access_log]
        options[:access_log_format] = opts[:access_log_format] if opts[:access_log_format]
        %i[shutdown_timeout request_timeout max_connections max_body max_requests max_requests_jitter max_memory memory_metric
           worker_boot_timeout before_fork before_worker_shutdown after_worker_exit on_booted on_restart control
           control_token refork_after before_refork refork_when].each do |key|
          options[key] = opts[key] if opts[key]
        end
        options[:worker_timeout] = opts[:worker_timeout] if opts.key?(:worker_timeout)
        options[:supervise] = opts[:supervise] if opts[:supervise].any?
        if opts[:warmup] && opts[:preload] && opts[:workers].positive?
          options[:before_fork] = NeverBlock::Server::HeapWarmup.after(options[:before_fork])
        end
        hook = opts[:on_worker_boot]
        build = !opts[:preload]
        if hook || build
          options[:on_worker_boot] = lambda do |index|
            hook&.call(index)
            next unless build

            # Only a worker that loads the app itself warms up: one forked
            # by the refork mold has it already, warmed up by the mold, and
            # its own warmup would write every page it shares with it.
            loaded = loader.built?
            loader.build
            NeverBlock::Server::HeapWarmup.boot if opts[:warmup] && !loaded
          end
        end
        options
      end

      def usage_error(message)
        @err.puts("neverblock serve: #{message}\n\n#{parser}")
        64
      end

      # Where a config file's settings are listed: the docs this gem ships.
      SETTINGS_LISTED = "The settings a config file takes are listed in " \
                        "#{File.expand_path('../../../docs/server.md', __dir__)}, \"The config file\"."

      # A config file's error (it names the file and line): that, and where
      # the settings are listed; the exit status of a usage error.
      def config_error(message)
        @err.puts("neverblock serve: #{message}\n#{SETTINGS_LISTED}")
        64
      end
    end
  end
end
