# frozen_string_literal: true

module NeverBlock
  # @api private
  # {Railtie} for apps that NeverBlock loads itself, after it was loaded
  # (`neverblock serve`, `rackup -s neverblock`): `gem "neverblock"` in the
  # Gemfile installs the Railtie only when Rails is loaded first, as
  # `Bundler.require` does in `rails server`.
  module RailsIntegration
    module_function

    # Runs the block, which loads an app: if the app loads Rails, the
    # Railtie is defined as soon as Active Support's is (TracePoint on class
    # ends, for the duration of the block only), before the app initializes.
    # Afterwards the ActiveRecord adapters are registered if ActiveRecord
    # was loaded.
    # @return [Object] the block's value.
    def while_loading_app
      install_railtie if rails_loaded?
      return yield.tap { after_load } if defined?(::NeverBlock::Railtie)

      hooked = defined?(::ActiveSupport.on_load) && hook_active_record
      trace = TracePoint.new(:end) do |event|
        # An app that uses ActiveRecord without Rails (establish_connection
        # in config.ru): the adapters register as ActiveRecord::Base loads.
        hooked ||= defined?(::ActiveSupport.on_load) && hook_active_record
        next unless defined?(::ActiveSupport::Railtie) && event.self.equal?(::ActiveSupport::Railtie)

        trace.disable
        install_railtie
      end
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

    # @return [true]
    def hook_active_record
      ::ActiveSupport.on_load(:active_record) { require "neverblock/active_record" }
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
