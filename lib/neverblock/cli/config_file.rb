# frozen_string_literal: true

require "uri"

module NeverBlock
  class CLI
    # The file `neverblock serve -C FILE` reads: Ruby, in the manner of
    # puma.rb. Every setting is optional; an option given on the command
    # line wins over the file.
    #
    #   # config/neverblock.rb
    #   bind "tcp://0.0.0.0:3000"          # repeatable; or: port 3000
    #   workers 4                          # 0: serve in the master's process
    #   preload true                       # load the app once, before forking
    #   warmup false                       # no Process.warmup once the app is loaded (default: true but in development)
    #   fiber_pool 500                     # requests answered at once, per worker
    #   adaptive_limit target_lag: 0.01    # or: adaptive_limit false (see NeverBlock::Server::ConcurrencyLimit)
    #   limits header_timeout: 5, idle_timeout: 10, max_body: 50 * 1024**2
    #   shutdown_timeout 20
    #   request_timeout 15                 # seconds; 503 past it (see NeverBlock::Server::Limits)
    #   early_hints true                   # env["rack.early_hints"]: 103 Early Hints (default false)
    #   opentelemetry true                 # a span per request, when the app loads OpenTelemetry (default false)
    #   cancel_on_hangup false             # let requests whose client hung up run on (default true)
    #   status "/_neverblock/status"
    #   access_log true
    #   access_log_format :json            # or a block given each entry's Hash, returning the line
    #   environment "production"
    #   pidfile "tmp/pids/neverblock.pid"
    #   log "log/neverblock.log"           # stdout and stderr, appended, line by line
    #   log_level :warn                    # NeverBlock's own log (default: RAILS_LOG_LEVEL, else info)
    #   fiber_stack_size "4M"
    #   worker_timeout 30                  # false: never kill a worker whose loop is held
    #   max_requests 10_000                # replace a worker after that many (plus jitter)
    #   max_memory "512M"                  # or bytes; memory_metric :pss to count shared pages shared
    #   refork_after 100, 1000             # fork the next generation from a worker that served 100, then every 1000
    #   before_fork { ActiveRecord::Base.connection_handler.clear_all_connections! }
    #   on_worker_boot { |index| MyStats.reconnect }
    #   before_worker_shutdown { |index| MyStats.flush }
    #   after_worker_exit { |index, status| warn "worker #{index}: #{status}" }
    #   on_booted { puts "all workers accept" }
    #   on_restart { puts "rolling restart" }
    #   before_refork { |index| MyStats.disconnect }   # in the mold, before it forks
    #   refork_when { |index| Rails.cache.exist?("warm") }   # only a worker for which it is true becomes the mold
    #   solid_queue true                   # supervise bin/jobs (as SOLID_QUEUE_IN_PUMA does)
    #   control "tcp://127.0.0.1:9293"     # /metrics, /stats, /tasks, neverblock ctl; control_token "secret"
    #   supervise "bin/sidekiq -C config/sidekiq.yml"   # any command kept running; repeatable
    class ConfigFile
      # Settings the file may make => the option they set.
      SETTINGS = %i[workers preload warmup fiber_pool max_connections max_body shutdown_timeout request_timeout early_hints access_log
                    opentelemetry cancel_on_hangup environment pidfile log fiber_stack_size worker_timeout worker_boot_timeout max_requests
                    max_requests_jitter max_memory memory_metric control control_token log_level].freeze

      # Blocks the file may give => what they are called with (see {Server#initialize}).
      HOOKS = { before_fork: "in the master, before the first worker is forked",
                on_worker_boot: "with the worker index, in each worker before it accepts",
                before_worker_shutdown: "with the worker index, in a worker that stops, once its requests are answered",
                after_worker_exit: "with the index and Process::Status, in the master, of each worker that exits",
                on_booted: "in the master, once every worker accepts",
                on_restart: "in the master, as a rolling restart (USR2) begins",
                before_refork: "with its worker index, in the worker promoted to mold, before it forks the next generation",
                refork_when: "with its worker index, in each worker until it returns true: the worker is warm and may become the mold" }.freeze

      # @param path [String]
      # @return [Hash] the options the file sets (`:bind` an Array, `:limits`
      #   a Hash, `:before_fork` and `:on_worker_boot` Procs).
      # @raise [ArgumentError] for an unknown setting or a bad value,
      #   naming the file and line.
      def self.load(path)
        config = new
        EVALUATE.call(config, File.read(path), path)
        config.options
      rescue NoMethodError, ArgumentError, TypeError => e
        line = e.backtrace_locations&.find { |location| location.path == path }&.lineno
        raise ArgumentError, "#{path}#{":#{line}" if line}: #{e.message}"
      end

      # Settings that only `neverblock serve` acts on (the rackup handler's
      # process is already running and has its app loaded and its binds).
      SERVE_ONLY = %i[bind preload environment pidfile log fiber_stack_size].freeze

      # The {NeverBlock::Server#initialize} options of a loaded file, for a
      # caller other than `neverblock serve` (the rackup handler, which
      # `rails server -u neverblock` uses). What only `neverblock serve`
      # does (see SERVE_ONLY) is left out.
      # @param options [Hash] what {.load} returned.
      # @return [Hash] Server options; `:ignored`, the settings left out;
      #   `:warmup`, when the file sets it (the caller's to act on).
      def self.server_options(options)
        options = options.dup
        ignored = SERVE_ONLY.select { |key| options.key?(key) }
        ignored.each { |key| options.delete(key) }
        limits = options.delete(:limits) || {}
        options[:access_log] = options[:access_log] ? $stdout : nil if options.key?(:access_log)
        options[:max_memory] = bytes(options[:max_memory], "max_memory") if options[:max_memory].is_a?(String)
        NeverBlock.log_level = options.delete(:log_level) if options.key?(:log_level) # the process's logger, not a Server option
        { **limits, **options, ignored: ignored }
      end

      # @param text [String, Integer] `4194304`, `4096K`, `4M`, `1G` (binary units).
      # @param name [String] the setting, for the error.
      # @return [Integer] bytes.
      # @raise [ArgumentError] for anything else.
      def self.bytes(text, name)
        match = /\A(\d+)([KMG]?)\z/i.match(text.to_s.strip) or
          raise ArgumentError, "#{name} #{text} (bytes, or a number with K, M or G)"
        Integer(match[1], 10) * { "" => 1, "K" => 1024, "M" => 1024**2, "G" => 1024**3 }.fetch(match[2].upcase)
      end

      # @return [Hash]
      attr_reader :options

      def initialize
        @options = {}
      end

      SETTINGS.each do |name|
        define_method(name) do |value|
          @options[name] = value
        end
      end

      # @param counts [Array<Integer>] `refork_after 100, 1000`: see
      #   {NeverBlock::Server::Cluster::Settings}.
      def refork_after(*counts)
        @options[:refork_after] = counts.flatten
      end

      # @param url [String] `tcp://HOST:PORT`, `unix://PATH` or
      #   `ssl://HOST:PORT?cert=PATH&key=PATH` (paths relative to the file).
      def bind(url)
        (@options[:bind] ||= []) << url.to_s
      end

      # As Puma's: `ssl_bind "0.0.0.0", 443, cert: "cert.pem", key: "key.pem"`.
      # @param options [Hash] cert:, key:, and optionally key_password:, min_version:.
      def ssl_bind(host, number, **options)
        bind("ssl://#{host}:#{Integer(number)}?#{URI.encode_www_form(options)}")
      end

      # @param number [Integer] the same as `bind "tcp://0.0.0.0:NUMBER"`.
      def port(number, host = "0.0.0.0")
        bind("tcp://#{host}:#{Integer(number)}")
      end

      # @param path [String, nil] where GET answers with the server's stats.
      def status(path)
        @options[:status_path] = path
      end

      # @param enabled [Boolean] false: admit up to `fiber_pool` requests
      #   whatever the load.
      # @param options [Hash] `min:`, `initial:`, `target_lag:` (seconds), see
      #   {NeverBlock::Server::ConcurrencyLimit#initialize}.
      def adaptive_limit(enabled = true, **options)
        raise ArgumentError, "adaptive_limit takes true, false or options, not both" if !enabled && options.any?

        @options[:adaptive_limit] = enabled && (options.empty? || options)
      end

      # @param format [Symbol, nil] `:common` or `:json`.
      # @yieldparam entry [Hash] instead of a format: the line's fields
      #   (see {NeverBlock::Server::AccessLog}); the block returns the line.
      def access_log_format(format = nil, &block)
        raise ArgumentError, "access_log_format takes :common, :json or a block" unless format.nil? ^ block.nil?

        @options[:access_log_format] = block || format.to_sym
      end

      # @param command [String, Array<String>] kept running by the master
      #   beside its workers (see {NeverBlock::Server::Cluster::Sidecars}).
      def supervise(command)
        (@options[:supervise] ||= []) << command
      end

      # @param enabled [Boolean] true: supervise the app's `bin/jobs` (Solid
      #   Queue's supervisor), as SOLID_QUEUE_IN_PUMA does.
      def solid_queue(enabled = true)
        supervise("bin/jobs") if enabled
      end

      # @param values [Hash] any {NeverBlock::Server::Limits} member.
      def limits(**values)
        (@options[:limits] ||= {}).merge!(values)
      end

      HOOKS.each_key do |name|
        define_method(name) do |&block|
          raise ArgumentError, "#{name} needs a block" unless block

          @options[name] = block
        end
      end

      # An unknown setting: an error naming the known ones.
      def method_missing(name, *_args)
        known = SETTINGS + HOOKS.keys + %i[bind ssl_bind port status limits adaptive_limit supervise solid_queue
                                           access_log_format refork_after]
        raise ArgumentError, "unknown setting #{name} (known: #{known.sort.join(', ')})"
      end

      def respond_to_missing?(_name, _include_private = false)
        false
      end
    end
  end
end

# The file is evaluated from here, outside `module NeverBlock`, so that its
# constants resolve as at the top of any Ruby file: `ActiveRecord` in a
# `before_fork` block is ::ActiveRecord, not NeverBlock::ActiveRecord.
NeverBlock::CLI::ConfigFile.const_set(:EVALUATE, ->(config, code, path) { config.instance_eval(code, path, 1) })
NeverBlock::CLI::ConfigFile.private_constant(:EVALUATE)
