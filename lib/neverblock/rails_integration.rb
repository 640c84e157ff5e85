# frozen_string_literal: true

require_relative "rails_integration/interlock"
require_relative "rails_integration/live"
require_relative "rails_integration/live_writes"

module NeverBlock
  # @api private
  # {Railtie} for apps that NeverBlock loads itself, after it was loaded
  # (`neverblock serve`, `rackup -s neverblock`): `gem "neverblock"` in the
  # Gemfile installs the Railtie only when Rails is loaded first, as
  # `Bundler.require` does in `rails server`.
  #
  # Also what {Server} needs to know of Rails, through two hooks, so that
  # the server names neither Active Support nor ActiveRecord:
  # {before_serving} (each serving process, before its loop starts) and
  # {server_stats} (the keys it adds to {Server#stats}).
  module RailsIntegration
    # RAILS_MAX_THREADS when it is not set (see {default_rails_max_threads}):
    # ActiveRecord connections per process in a generated Rails app. Two
    # workers then open at most 50, under PostgreSQL's default 100.
    RAILS_MAX_THREADS_DEFAULT = 25

    # An ActiveRecord pool smaller than this gets a warning when a server
    # starts (see {warn_about_a_small_pool}).
    SMALL_ACTIVE_RECORD_POOL = 10

    module_function

    # A Rails app's generated database.yml sizes ActiveRecord's pool from
    # RAILS_MAX_THREADS (else 5), a count of threads; here each request is a
    # fiber, hundreds run at once, and each holds a connection from its
    # first query to its end, so the sixth at once would wait
    # `checkout_timeout` and fail. Unset, it becomes
    # {RAILS_MAX_THREADS_DEFAULT}; in a Rails app's directory `out` is told.
    # Must run before the app initializes (and reads database.yml).
    # @param out [IO]
    # @return [void]
    def default_rails_max_threads(out)
      return if ENV.key?("RAILS_MAX_THREADS")

      ENV["RAILS_MAX_THREADS"] = RAILS_MAX_THREADS_DEFAULT.to_s
      # Said only where it changes something: a database.yml that reads the
      # variable (as a generated one does); one with its own pool sizes keeps them.
      return unless File.exist?("config/database.yml") && File.read("config/database.yml").include?("RAILS_MAX_THREADS")

      out.puts("RAILS_MAX_THREADS was not set: set to #{RAILS_MAX_THREADS_DEFAULT}, so that a generated " \
               "config/database.yml gives ActiveRecord a pool of #{RAILS_MAX_THREADS_DEFAULT} connections per process")
    end

    # Rails 8's generated config/puma.rb runs Solid Queue in the server
    # (`plugin :solid_queue if ENV["SOLID_QUEUE_IN_PUMA"]`, which Kamal's
    # deploy.yml sets): the same variable has a NeverBlock master supervise
    # the app's bin/jobs (Solid Queue's supervisor), for `neverblock serve`
    # and `rails server -u neverblock` alike. Reads the current directory,
    # the app's root.
    # @param supervise [Array<String, Array<String>>] the commands already
    #   supervised (a `-C` file's `solid_queue true`, `--supervise`).
    # @param err [IO] told when bin/jobs is missing.
    # @param who [String] the command, for that message.
    # @return [Array<String, Array<String>>] `supervise`, plus `"bin/jobs"`
    #   when SOLID_QUEUE_IN_PUMA is set, bin/jobs exists and no bin/jobs
    #   command is there yet.
    def supervise_solid_queue(supervise, err, who)
      return supervise unless ENV["SOLID_QUEUE_IN_PUMA"]
      return supervise if supervise.any? { |command| Array(command).join(" ").split.first&.end_with?("bin/jobs") }
      return supervise + ["bin/jobs"] if File.file?("bin/jobs")

      err.puts("#{who}: SOLID_QUEUE_IN_PUMA is set but #{File.expand_path('bin/jobs')} does not exist; " \
               "not running Solid Queue")
      supervise
    end

    # Runs the block, which loads an app: if the app loads Rails, the
    # Railtie is defined when the app's class is (Active Support's
    # `before_configuration` hook), before the app initializes; if it loads
    # ActiveRecord, the adapters register as ActiveRecord::Base loads.
    # Afterwards the ActiveRecord adapters are registered if ActiveRecord
    # was loaded.
    #
    # Both hooks need Active Support's `on_load`, which the app loads
    # itself: a `script_compiled` TracePoint (one event per file or string
    # compiled) watches for it and ends as soon as it is there. Not a
    # `:class`/`:end` TracePoint: enabling one of those rewrites every
    # instruction sequence in the process, which in a forked worker copies
    # every page of bytecode (measured: 530 ms per worker boot, most of a
    # crash-looping worker's respawn time).
    # @return [Object] the block's value.
    def while_loading_app
      install_railtie if rails_loaded?
      return yield.tap { after_load } if defined?(::NeverBlock::Railtie) || hook_active_support

      trace = TracePoint.new(:script_compiled) { trace.disable if hook_active_support }
      trace.enable
      begin
        yield
      ensure
        trace.disable
      end.tap { after_load }
    end

    # After an app loaded: registers the `neverblock_*` adapters when it
    # uses ActiveRecord (they resolve at the first connection).
    # @return [void]
    def after_load
      require_relative "active_record" if defined?(::ActiveRecord::ConnectionAdapters) && !defined?(::NeverBlock::ActiveRecord::ADAPTERS)
    end

    # Warns for each database of the app's environment that
    # config/database.yml gives a `neverblock_*` adapter but that ActiveRecord
    # resolved to another one: a URL's scheme (DATABASE_URL, `url:`) decides
    # the adapter in Rails, and `postgres://` means the stock one.
    # @return [void]
    def warn_about_overridden_adapters(app)
      return unless defined?(::ActiveRecord::Base)

      env = ::Rails.env.to_s
      written = app.config.database_configuration[env]
      return unless written.is_a?(Hash)

      written = { "primary" => written } if written.key?("adapter") || written.key?("url")
      ::ActiveRecord::Base.configurations.configs_for(env_name: env).each do |config|
        wanted = written.dig(config.name, "adapter").to_s
        next unless wanted.start_with?("neverblock_") && config.adapter.to_s != wanted

        NeverBlock.logger.warn("NeverBlock: config/database.yml says adapter: #{wanted} for #{config.name.inspect} " \
                               "(#{env}), but its URL (DATABASE_URL or url:) names #{config.adapter.inspect}, and in " \
                               "Rails the URL wins: write the URL as #{wanted.tr('_', '-')}://user:password@host/database")
      end
    rescue StandardError => e
      NeverBlock.logger.debug("NeverBlock") { "could not compare database.yml with ActiveRecord's configurations: #{e.class}: #{e.message}" }
    end

    # Called by {Server#serve_here} in each serving process (a worker, or
    # the one process with `workers: 0`), once its listeners are open and
    # before its loop starts: an app built before the server (rackup's)
    # gets the ActiveRecord adapters ({after_load}); Active Support's state
    # becomes per fiber; ActionController::Live actions run on the loop
    # ({Live}); and databases that would serve poorly (a blocking adapter, a
    # small pool) get a warning with the fix.
    # @return [void]
    def before_serving
      after_load
      isolate_active_support_per_fiber
      use_a_fiber_interlock
      run_live_actions_on_the_loop
      warn_about_blocking_adapters
    end

    # ActionController::Live actions become tasks of their requests ({Live}),
    # whose writes go straight to their clients ({LiveWrites}), once Action
    # Controller loads (now, if it has): only in a process that
    # NeverBlock::Server serves, since only the server calls this. A prepend
    # to the module reaches the controllers that already include it.
    # @return [void]
    def run_live_actions_on_the_loop
      return unless defined?(::ActiveSupport.on_load)

      ::ActiveSupport.on_load(:action_controller) do
        ::ActionController::Live.prepend(::NeverBlock::RailsIntegration::Live)
        ::ActionController::Live::Buffer.prepend(::NeverBlock::RailsIntegration::LiveWrites::Buffer)
        ::ActionController::Live::Response.prepend(::NeverBlock::RailsIntegration::LiveWrites::Response)
      end
    end

    # An app that reloads code (Rails' development mode) gets an {Interlock}
    # that counts requests by fiber: Rails' own counts them by thread, and
    # would unload constants under requests still running (see {Interlock}).
    def use_a_fiber_interlock
      return unless defined?(::ActiveSupport::Dependencies) && ::ActiveSupport::Dependencies.respond_to?(:interlock=)
      return unless defined?(::Rails) && ::Rails.respond_to?(:application) && ::Rails.application
      return unless ::Rails.application.config.respond_to?(:reloading_enabled?) && ::Rails.application.config.reloading_enabled?
      return if ::ActiveSupport::Dependencies.interlock.is_a?(Interlock)

      ::ActiveSupport::Dependencies.interlock = Interlock.new
    end

    # The keys {Server#stats} ends with (in a serving process).
    # @return [Hash] `{active_record_pools: [...]}`: see {active_record_pools}.
    def server_stats
      { active_record_pools: active_record_pools }
    end

    # ActiveRecord's connection pools that have connections (when the app
    # uses ActiveRecord): `[{name:, adapter:, size:, connections:, busy:,
    # dead:, idle:, waiting:, checkout_timeout:}]`.
    def active_record_pools
      return [] unless defined?(::ActiveRecord::Base) && ::ActiveRecord::Base.respond_to?(:connection_handler)

      ::ActiveRecord::Base.connection_handler.connection_pool_list(:all).filter_map do |pool|
        stat = pool.stat
        next if stat[:connections].zero?

        { name: pool.db_config.name, adapter: pool.db_config.adapter, **stat }
      end
    rescue StandardError => e
      [{ error: "#{e.class}: #{e.message}" }]
    end

    # Requests are fibers of one thread: Active Support's per-request state
    # (ActiveRecord's connection and transaction, CurrentAttributes) must be
    # per fiber, or concurrent requests share one database connection. An
    # app that loaded Active Support with the `:thread` level gets `:fiber`,
    # with a warning (a Rails app with the neverblock gem already has it).
    def isolate_active_support_per_fiber
      return unless defined?(::ActiveSupport::IsolatedExecutionState)

      state = ::ActiveSupport::IsolatedExecutionState
      return if state.isolation_level == :fiber

      NeverBlock.logger.warn("NeverBlock::Server: Active Support's isolation level was #{state.isolation_level.inspect}; " \
                             "set to :fiber, since every request is a fiber (in Rails: " \
                             "config.active_support.isolation_level = :fiber)")
      state.isolation_level = :fiber
    end

    # The stock mysql2 adapter waits for MySQL inside C, where the fiber
    # scheduler never hears of it: each query stops the whole process, so
    # requests wait for each other's queries. It works, slowly; say so once
    # at start with the fix, rather than let a benchmark find out.
    def warn_about_blocking_adapters
      return unless defined?(::ActiveRecord::Base) && ::ActiveRecord::Base.respond_to?(:configurations)

      env = ::ActiveRecord::ConnectionHandling::DEFAULT_ENV.call.to_s
      configs = ::ActiveRecord::Base.configurations.configs_for(env_name: env)
      warn_about_small_pools(configs, env)
      configs.each do |config|
        next unless config.adapter.to_s == "mysql2"

        NeverBlock.logger.warn("NeverBlock::Server: ActiveRecord database #{config.name.inspect} (#{env}) uses the " \
                               "stock mysql2 adapter, whose queries block the whole process (mysql2 waits inside C, " \
                               "out of the fiber scheduler's sight): concurrent requests wait for each other's " \
                               "queries. Use adapter: neverblock_mysql2 or neverblock_trilogy in config/database.yml")
      end
    rescue StandardError => e
      NeverBlock.logger.debug("NeverBlock::Server") { "could not read ActiveRecord's configurations: #{e.class}: #{e.message}" }
    end

    # ActiveRecord's pool is sized for threads (Rails generates 5); here a
    # request holds a connection from its first query to its end, and the
    # sixth request using the database at once waits `checkout_timeout`
    # and fails. One line per process names the small pools (a Rails 8 app
    # has four databases) and the database.yml key its Rails reads
    # (`max_connections:` from 8.1, which deprecates `pool:`).
    def warn_about_small_pools(configs, env)
      small = configs.filter_map do |config|
        size = config.respond_to?(:max_connections) ? config.max_connections : config.pool
        "#{config.name} #{size}" if size && size < SMALL_ACTIVE_RECORD_POOL
      end
      return if small.empty?

      key = configs.first.respond_to?(:max_connections) ? "max_connections" : "pool"
      NeverBlock.logger.warn("NeverBlock::Server: small ActiveRecord pools (#{env}: #{small.join(', ')}): each request " \
                             "holds a connection to its end; set #{key}: 25 in config/database.yml")
    end

    # Once Active Support's load hooks exist: the adapters register when
    # ActiveRecord::Base loads, and a Rails app's class, as it is defined,
    # installs the Railtie (its initializers and settings apply at
    # `initialize!`, which comes later).
    # @return [Boolean] whether the hooks are in place.
    def hook_active_support
      return false unless defined?(::ActiveSupport.on_load)

      ::ActiveSupport.on_load(:active_record) { require "neverblock/active_record" }
      ::ActiveSupport.on_load(:before_configuration) { ::NeverBlock::RailsIntegration.install_railtie }
      true
    end

    def rails_loaded?
      defined?(::Rails::Railtie) && defined?(::ActiveSupport::Railtie)
    end

    def install_railtie
      require_relative "railtie"
    end
  end
end
