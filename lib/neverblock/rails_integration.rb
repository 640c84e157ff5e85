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

      trace = TracePoint.new(:end) do |event|
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

    def rails_loaded?
      defined?(::Rails::Railtie) && defined?(::ActiveSupport::Railtie)
    end

    def install_railtie
      require_relative "railtie"
    end
  end
end
