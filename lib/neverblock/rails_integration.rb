# frozen_string_literal: true

module NeverBlock
  # @api private
  # {Railtie} for apps that NeverBlock loads itself, after it was loaded
  # (`neverblock serve`, `rackup -s neverblock`): `gem "neverblock"` in the
  # Gemfile installs the Railtie only when Rails is loaded first, as
  # `Bundler.require` does in `rails server`.
  module RailsIntegration
    # RAILS_MAX_THREADS when it is not set (see {default_rails_max_threads}):
    # ActiveRecord connections per process in a generated Rails app. Two
    # workers then open at most 50, under PostgreSQL's default 100.
    RAILS_MAX_THREADS_DEFAULT = 25

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
      return unless File.exist?("config/database.yml")

      out.puts("RAILS_MAX_THREADS was not set: set to #{RAILS_MAX_THREADS_DEFAULT}, so that a generated " \
               "config/database.yml gives ActiveRecord a pool of #{RAILS_MAX_THREADS_DEFAULT} connections per process")
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
