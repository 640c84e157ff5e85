# frozen_string_literal: true

# The Rails app of bench/jobs.rb: production mode, Active Job on Solid Queue,
# one job class (LlmCallJob). What the bench sets:
#
# NB_JOBS_EXECUTION :: threads (Solid Queue's thread pool), async (its fiber
#   pool on the async gem's reactor) or neverblock (NeverBlock loaded: its
#   Railtie gives fiber workers NeverBlock::SolidQueue::FiberPool)
# NB_JOBS_CONCURRENCY :: the worker's threads: or fibers: (config/queue.yml)
# NB_JOBS_POOL :: ActiveRecord's connections per process (config/database.yml)
# DATABASE_URL :: the bench's database, its Solid Queue tables loaded
# NB_JOBS_UPSTREAM :: the fake LLM API's base URL (the job's GET)
require "rails"
require "active_record/railtie"
require "active_job/railtie"
require "solid_queue"

module JobsBench
  EXECUTION = ENV.fetch("NB_JOBS_EXECUTION", "neverblock")
  NEVERBLOCK = EXECUTION == "neverblock"
end

# What Bundler.require does in a generated app with NeverBlock in its Gemfile; the other two
# executions run as an app without it.
require "neverblock" if JobsBench::NEVERBLOCK

module JobsBench
  class Application < Rails::Application
    config.load_defaults Rails::VERSION::STRING.to_f
    config.root = File.expand_path("..", __dir__)
    config.eager_load = true
    config.logger = Logger.new($stdout, level: :warn)
    config.secret_key_base = "x" * 64
    config.active_job.queue_adapter = :solid_queue
    config.solid_queue.logger = Logger.new($stdout, level: :warn)
    # Solid Queue's fiber workers need it; NeverBlock's Railtie sets it, an app without NeverBlock sets it itself.
    config.active_support.isolation_level = :fiber if EXECUTION == "async"
  end
end
