# frozen_string_literal: true

# The minimal Rails app of bench/rails.rb (ActionController::API and
# ActiveRecord, production): GET /sleep runs `select pg_sleep(1)`, GET /fast
# `select 1`, through config/database.yml's adapter, NB_RAILS_ADAPTER
# (neverblock_postgresql under NeverBlock, postgresql under Puma), pool NB_RAILS_POOL.

ENV["RAILS_ENV"] ||= "production"
ENV["SECRET_KEY_BASE"] ||= "neverblock-bench-#{'0' * 48}" # no secrets here; Rails insists on one

require "logger"
require "rails"
require "active_record/railtie"
require "action_controller/railtie"
require_relative "../support/ruby_description"
# Registers neverblock_postgresql and sets fiber isolation (its Railtie keeps it).
require "neverblock/active_record" if ENV.fetch("NB_RAILS_ADAPTER", "neverblock_postgresql").start_with?("neverblock_")

module NeverBlockBenchRails
  # No middleware beyond the API stack, no logging, production's settings
  # written out (there is no config/environments/production.rb): no reloader's
  # file watcher nor public file server stats files per request.
  class Application < Rails::Application
    config.load_defaults Rails::VERSION::STRING.to_f
    config.root = __dir__
    config.api_only = true
    config.enable_reloading = false # production.rb's; without it: a Reloader and a file watcher per request
    config.eager_load = true
    config.public_file_server.enabled = false
    config.consider_all_requests_local = false
    config.action_controller.perform_caching = true
    config.active_support.report_deprecations = false
    config.logger = Logger.new(nil)
    config.log_level = :fatal
    config.active_record.logger = nil
  end
end

# The benchmark's two actions.
class BenchController < ActionController::API
  # One second in the database (`execute`: ActiveRecord would warn about
  # pg_sleep's void type), marked IO-bound first for Puma 8's IO mode.
  def slow
    request.env["puma.mark_as_io_bound"]&.call
    ActiveRecord::Base.with_connection { |conn| conn.execute("select pg_sleep(1)").clear }
    render plain: "slept\n"
  end

  def fast
    ActiveRecord::Base.with_connection { |conn| conn.select_value("select 1") }
    render plain: "ok\n"
  end

  # Which Ruby serves, and whether YJIT is on in it (PeerServers.check_ruby).
  def ruby
    render plain: NeverBlockBench.ruby_description
  end
end

Rails.application.initialize!

# Drawn after initialize!, which clears routes drawn earlier when there is no config/routes.rb.
Rails.application.routes.draw do
  get "/sleep", to: "bench#slow"
  get "/fast", to: "bench#fast"
  get "/ruby", to: "bench#ruby"
end
