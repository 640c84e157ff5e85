# frozen_string_literal: true

# A minimal Rails app for the 2009 Rails benchmark (bench/rails.rb): ActionController::API
# and ActiveRecord, production mode, two actions.
#
#   GET /sleep  select pg_sleep(1)
#   GET /fast   select 1
#
# The database is config/database.yml's: `adapter: neverblock_postgresql` when served by
# NeverBlock::Server (the stock adapter with fiber-level connection ownership; see
# lib/neverblock/active_record.rb), `postgresql` under Puma. Run it with either:
#
#   NB_RAILS_ADAPTER=neverblock_postgresql NB_RAILS_POOL=200 \
#     bundle exec neverblock serve bench/rails/config.ru -w 0 -E production
#   NB_RAILS_ADAPTER=postgresql NB_RAILS_POOL=5 \
#     BUNDLE_GEMFILE=bench/gemfiles/servers.gemfile bundle exec puma -e production bench/rails/config.ru

ENV["RAILS_ENV"] ||= "production"
ENV["SECRET_KEY_BASE"] ||= "neverblock-bench-#{'0' * 48}" # no secrets here; Rails insists on one

require "logger"
require "rails"
require "active_record/railtie"
require "action_controller/railtie"
# Registers neverblock_postgresql and sets fiber isolation (its Railtie keeps it).
require "neverblock/active_record" if ENV.fetch("NB_RAILS_ADAPTER", "neverblock_postgresql").start_with?("neverblock_")

module NeverBlockBenchRails
  # The app: no middleware beyond the API stack, no logging, production's
  # settings written out (there is no config/environments/production.rb).
  # Checked by tracing one /fast request: with Rails' defaults it made 17
  # File.mtime, 9 File.file? and 7 File.exist? calls (the reloader's file
  # watcher and the public file server); with these, none, and neither
  # ActionDispatch::Reloader nor ActionDispatch::Static is in the stack.
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
  # One second in the database. `execute`, not `select_value`: pg_sleep returns
  # void, whose type ActiveRecord would warn about. First it tells Puma 8 the
  # request waits on IO, for its IO mode (max_io_threads; nil elsewhere).
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
    render plain: "#{RUBY_DESCRIPTION} yjit=#{defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled? ? true : false}\n"
  end
end

Rails.application.initialize!

# Drawn after initialize!, which clears routes drawn earlier when there is no config/routes.rb.
Rails.application.routes.draw do
  get "/sleep", to: "bench#slow"
  get "/fast", to: "bench#fast"
  get "/ruby", to: "bench#ruby"
end
