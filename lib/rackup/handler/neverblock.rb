# frozen_string_literal: true

require "rackup/handler"
require "neverblock/server"
require "neverblock/rails_integration"

module Rackup
  module Handler
    # `rackup -s neverblock` and `rails server -u neverblock`: serves the app
    # with {NeverBlock::Server}. By default in this one process (`Workers=0`:
    # rackup and `rails server` are development tools); `-O Workers=N` forks
    # N workers.
    #
    #   rackup -s neverblock -o 127.0.0.1 -p 9292 config.ru
    #   rackup -s neverblock -O Workers=2 -O Status=/_status -O RequestTimeout=15
    #   bin/rails server -u neverblock
    module NeverBlock
      class << self
        # @param app [#call] the Rack app.
        # @param options [Hash] rackup's options: `:Host`, `:Port`, and the
        #   handler's own (see {valid_options}) as Strings.
        # @yieldparam server [::NeverBlock::Server] before it runs.
        # @return [void] once the server has stopped (INT/TERM or {shutdown}).
        # An address it cannot listen on ends the process with one line
        # (exit 1), as `neverblock serve` does, not a backtrace.
        def run(app, **options)
          # The server's output is the app's log (Rails logs to STDOUT in a
          # container): each line goes out as it is written, also into a
          # pipe or a file, and a kill loses none of it.
          $stdout.sync = true
          $stderr.sync = true
          settings = with_sidecars(with_web_concurrency({ **config_file_options, **server_options(options) }))
          warmup = ::NeverBlock::Server::HeapWarmup.wanted?(settings.delete(:warmup))
          # The app is loaded (rackup and `rails server` build it first):
          # its heap is warmed up before it serves, or in a master last
          # before it forks (see NeverBlock::Server::HeapWarmup).
          forking = settings[:workers].is_a?(Integer) && settings[:workers].positive? # Server.new says what else is wrong
          settings[:before_fork] = ::NeverBlock::Server::HeapWarmup.after(settings[:before_fork]) if warmup && forking
          server = ::NeverBlock::Server.new(app, **settings)
          @server = server
          yield server if block_given?
          ::NeverBlock::Server::HeapWarmup.boot if warmup && server.workers.zero?
          $stdout.puts("NeverBlock #{::NeverBlock::VERSION} listening on #{server.bound_addresses.join(', ')} " \
                       "(#{server.workers.zero? ? 'one process' : ::NeverBlock::Server.workers_phrase(server.workers)}, pid #{Process.pid})")
          server.run(handle_signals: true)
        rescue Errno::EADDRINUSE, Errno::EACCES, Errno::EADDRNOTAVAIL => e
          abort("NeverBlock: #{e.message}")
        ensure
          @server = nil
        end

        # Stops the server started by {run} (rackup calls this on shutdown).
        # @return [void]
        def shutdown
          @server&.stop
        end

        # @return [Hash{String => String}] what `rackup -s neverblock -h` lists.
        def valid_options
          {
            "Host=HOST" => "hostname to listen on (default: localhost)",
            "Port=PORT" => "port to listen on (default: 9292)",
            "Bind=URL" => "tcp://HOST:PORT, unix://PATH or ssl://HOST:PORT?cert=PEM&key=PEM instead of Host/Port",
            "Workers=N" => "worker processes to fork (default: 0, serve in this process)",
            "FiberPool=N" => "requests served at once per process (default: 1000)",
            "Status=PATH" => "answer GET PATH with the server's stats as JSON",
            "RequestTimeout=SECONDS" => "answer 503 to a request still waiting this long (default: none)",
            "OpenTelemetry=BOOL" => "a span per request, when the app loads OpenTelemetry (default: false)",
            "EarlyHints=BOOL" => "env[\"rack.early_hints\"]: 103 Early Hints (default: false; rails server --early-hints)",
            "AccessLog=BOOL" => "log one line per request to stdout (default: false)",
            "Warmup=BOOL" => "Process.warmup (Ruby 3.3+) once the app is loaded, before it serves or forks (default: true, " \
                             "but in development)"
          }
        end

        # The file `rails server` would read for Puma is config/puma.rb;
        # for NeverBlock it is config/neverblock.rb (from the directory the
        # server starts in, the app's root), the file `neverblock serve -C`
        # reads: its limits, workers, hooks, timeouts... apply, and rackup's
        # own options (`-p`, `-b`, `-O`) win. What only `neverblock serve`
        # does with it (bind, preload, pidfile, log...) is left out, saying so.
        CONFIG_FILE = "config/neverblock.rb"

        private

        def config_file_options
          return {} unless File.file?(CONFIG_FILE)

          require "neverblock/cli/config_file"
          options = ::NeverBlock::CLI::ConfigFile.server_options(::NeverBlock::CLI::ConfigFile.load(File.expand_path(CONFIG_FILE)))
          ignored = options.delete(:ignored)
          $stdout.puts("NeverBlock: reading #{CONFIG_FILE}#{"; #{ignored.join(', ')} apply to `neverblock serve -C` only" if ignored.any?}")
          options
        end

        # Serves in this one process (`workers: 0`) unless told otherwise,
        # but what is to be supervised (Solid Queue's bin/jobs under
        # SOLID_QUEUE_IN_PUMA, which Kamal's deploy.yml sets, or a
        # config/neverblock.rb `supervise`) needs a master: then one worker
        # serves beside it, saying so. Puma runs Solid Queue in single mode
        # too (a fork of its one process); a NeverBlock master is what
        # restarts bin/jobs when it dies and stops it on TERM. An explicit
        # `workers 0` (or rackup's `-O Workers=0`; `rails server` has no
        # -O) keeps one process, and the server's warning that nothing is
        # supervised.
        def with_sidecars(options)
          options[:supervise] = ::NeverBlock::RailsIntegration.supervise_solid_queue(
            options.fetch(:supervise, []), $stderr, "NeverBlock"
          )
          return { workers: 0, **options } if options.key?(:workers) || options[:supervise].empty?

          commands = options[:supervise].map { |command| Array(command).join(" ") }.join(", ")
          $stdout.puts("NeverBlock: a master supervises #{commands} beside 1 worker " \
                       "(for more: WEB_CONCURRENCY=N, or `workers N` in #{CONFIG_FILE})")
          { **options, workers: 1 }
        end

        # WEB_CONCURRENCY, which every Rails 8 app's config/deploy.yml and
        # config/puma.rb name (and Puma reads), is the worker count unless
        # rackup's -O Workers or a `workers` in config/neverblock.rb says
        # otherwise. A value that is not a count is an error, not ignored.
        def with_web_concurrency(options)
          value = ENV.fetch("WEB_CONCURRENCY", "").strip
          return options if value.empty? || options.key?(:workers)

          workers = Integer(value, 10, exception: false)
          abort("NeverBlock: WEB_CONCURRENCY=#{value} is not a number of worker processes (0: this one process)") unless workers&.between?(0, 1024)

          $stdout.puts("NeverBlock: WEB_CONCURRENCY=#{value}: #{workers.zero? ? 'one process' : ::NeverBlock::Server.workers_phrase(workers)} " \
                       "(`workers N` in #{CONFIG_FILE} wins over it)")
          { **options, workers: workers }
        end

        # The spellings of a BOOL option that turn it on.
        YES = %w[true yes 1].freeze

        def server_options(options)
          host = options[:Host] || "localhost"
          host = "[#{host}]" if host.include?(":") && !host.start_with?("[")
          bind = options[:Bind] || "tcp://#{host == 'localhost' ? '127.0.0.1' : host}:#{Integer(options[:Port] || 9292)}"
          result = { bind: [bind] }
          result[:workers] = Integer(options[:Workers]) if options[:Workers]
          result[:fiber_pool] = Integer(options[:FiberPool]) if options[:FiberPool]
          result[:status_path] = options[:Status] if options[:Status]
          result[:request_timeout] = Float(options[:RequestTimeout]) if options[:RequestTimeout]
          result[:access_log] = $stdout if yes?(options[:AccessLog])
          # `rails server --early-hints` passes early_hints: true.
          result[:early_hints] = true if options[:early_hints] || yes?(options[:EarlyHints])
          result[:opentelemetry] = true if yes?(options[:OpenTelemetry])
          result[:warmup] = yes?(options[:Warmup]) if options[:Warmup]
          result
        end

        # Whether a BOOL option (`-O Name=true`) says yes.
        def yes?(value)
          YES.include?(value.to_s)
        end
      end
    end

    register :neverblock, NeverBlock
    # `rails server -u neverblock` loads this file after config/application.rb
    # and before the app initializes and reads database.yml.
    ::NeverBlock::RailsIntegration.default_rails_max_threads($stdout)
  end
end
