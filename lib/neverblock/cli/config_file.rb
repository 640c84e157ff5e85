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
    #   fiber_pool 500                     # requests answered at once, per worker
    #   adaptive_limit target_lag: 0.01    # or: adaptive_limit false (see NeverBlock::Server::ConcurrencyLimit)
    #   limits header_timeout: 5, idle_timeout: 10, max_body: 50 * 1024**2
    #   shutdown_timeout 20
    #   request_timeout 15                 # seconds; 503 past it (see NeverBlock::Server::Limits)
    #   early_hints true                   # env["rack.early_hints"]: 103 Early Hints (default false)
    #   status "/_neverblock/status"
    #   access_log true
    #   environment "production"
    #   pidfile "tmp/pids/neverblock.pid"
    #   log "log/neverblock.log"           # stdout and stderr, appended, line by line
    #   fiber_stack_size "4M"
    #   before_fork { ActiveRecord::Base.connection_handler.clear_all_connections! }
    #   on_worker_boot { |index| MyStats.reconnect }
    class ConfigFile
      # Settings the file may make => the option they set.
      SETTINGS = %i[workers preload fiber_pool max_connections max_body shutdown_timeout request_timeout early_hints access_log
                    environment pidfile log fiber_stack_size].freeze

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

      # @param values [Hash] any {NeverBlock::Server::Limits} member.
      def limits(**values)
        (@options[:limits] ||= {}).merge!(values)
      end

      # @yield in the master, before the first worker is forked.
      def before_fork(&block)
        raise ArgumentError, "before_fork needs a block" unless block

        @options[:before_fork] = block
      end

      # @yieldparam index [Integer] in each worker, before it loads the app
      #   (unless preloaded) and accepts.
      def on_worker_boot(&block)
        raise ArgumentError, "on_worker_boot needs a block" unless block

        @options[:on_worker_boot] = block
      end

      # An unknown setting: an error naming the known ones.
      def method_missing(name, *_args)
        raise ArgumentError, "unknown setting #{name} (known: #{(SETTINGS + %i[bind port status limits before_fork
                                                                              on_worker_boot adaptive_limit]).sort.join(', ')})"
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
