# frozen_string_literal: true

require "rails/railtie"
require_relative "rails_integration"

module NeverBlock
  # What `gem "neverblock"` does in a Rails app (Bundler.require loads the
  # gem after Rails, so this Railtie is in place before the app boots):
  #
  # - Active Support's isolation level is `:fiber` (unless the app sets
  #   `config.active_support.isolation_level` itself), so every request
  #   fiber has its own ActiveRecord connection and transaction;
  # - once ActiveRecord loads, `neverblock/active_record` is required, which
  #   registers the `neverblock_postgresql`, `neverblock_mysql2` and
  #   `neverblock_trilogy` adapters: one word in database.yml is enough;
  # - once Solid Queue loads, `neverblock/solid_queue` is required: workers
  #   configured with `fibers:` run their jobs on NeverBlock's loop.
  class Railtie < ::Rails::Railtie
    config.active_support.isolation_level = :fiber

    # Registered while the app initializes (before any connection is
    # made), or when ActiveRecord loads later than that.
    initializer "neverblock.active_record_adapters", before: :load_config_initializers do
      require "neverblock/active_record" if defined?(::ActiveRecord::ConnectionAdapters)
    end
    ActiveSupport.on_load(:active_record) { require "neverblock/active_record" }

    # Solid Queue's fiber workers (`fibers: N`) run their jobs as NeverBlock
    # tasks, without the `async` gem (NeverBlock::SolidQueue). Only when
    # the app loads Solid Queue.
    ActiveSupport.on_load(:solid_queue) { require "neverblock/solid_queue" }

    # DATABASE_URL (or a `url:` key) wins over database.yml's `adapter:` in
    # Rails: with `postgres://...` the stock adapter is used after all. Say
    # so at boot, with the URL scheme that keeps NeverBlock's.
    initializer "neverblock.database_url_check", after: "active_record.initialize_database" do |app|
      RailsIntegration.warn_about_overridden_adapters(app)
    end
  end
end
