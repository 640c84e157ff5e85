# frozen_string_literal: true

# A Rails API app cut to what it needs: no `rails new`, no config/environments/
# (one configuration for every environment), and the gems of NeverBlock's own
# Gemfile only. Loaded by config.ru (neverblock serve), bin/rails and Rakefile.
require "logger"
require "rails"
require "active_record/railtie"
require "action_controller/railtie"
# What Bundler.require does in a generated app, after Rails: NeverBlock's
# Railtie registers the neverblock_* adapters and makes Active Support
# isolate state per fiber, so each request (a fiber) has its own connection.
require "neverblock"

module RailsApi
  class Application < Rails::Application
    config.load_defaults Rails::VERSION::STRING.to_f
    config.root = File.expand_path("..", __dir__)
    config.api_only = true

    # The same in every environment: classes loaded once, at boot.
    config.eager_load = true
    config.enable_reloading = false
    config.consider_all_requests_local = false
    config.hosts.clear
    config.logger = ActiveSupport::Logger.new($stdout)
    config.log_level = :info
    config.cache_store = :memory_store
    # Nothing is signed or encrypted here (no cookies, no sessions); a real
    # app sets SECRET_KEY_BASE.
    config.secret_key_base = ENV.fetch("SECRET_KEY_BASE") { "examples-rails-api-#{'0' * 45}" }
    # db:prepare must not rewrite the committed db/schema.rb.
    config.active_record.dump_schema_after_migration = false
  end
end
