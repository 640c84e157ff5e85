# frozen_string_literal: true

# bench/streams.rb's `live` part: the same event streams as streams_app.ru,
# written the way a Rails app writes them, from an ActionController::Live
# action (a minimal Rails app, production settings, no logging):
#   GET /stream?events=40&interval_ms=50
#       `events` events on a fixed schedule `interval_ms` apart, each
#       `response.stream.write`, then `response.stream.close`
#   GET /body?events=40&interval_ms=50
#       the same events as the action's Rack body (`self.response_body =`
#       an object whose `each` yields them): the Rails baseline for Live;
#       501 before Rails 8.1, which buffers such a body whole
#   GET /ruby   the serving Ruby (PeerServers.check_ruby)
#   GET /stream-gaps  the streams' worst gaps as the app wrote them (StreamGaps)
# Under `neverblock serve` the action runs on the loop (NeverBlock's
# Railtie); under Falcon and Puma, in a thread of Rails' Live pool.

ENV["RAILS_ENV"] ||= "production"
ENV["SECRET_KEY_BASE"] ||= "neverblock-bench-#{'0' * 48}" # no secrets here; Rails insists on one

require "logger"
require "rails"
require "action_controller/railtie"
require_relative "ruby_description"
require_relative "stream_gaps"

module NeverBlockBenchLive
  # API stack only, production's settings written out (no config/ directory).
  class Application < Rails::Application
    config.load_defaults Rails::VERSION::STRING.to_f
    config.root = __dir__
    config.api_only = true
    config.enable_reloading = false
    config.eager_load = false # nothing to load: the one controller is below
    config.public_file_server.enabled = false
    config.consider_all_requests_local = false
    config.active_support.report_deprecations = false
    config.logger = Logger.new(nil)
    config.log_level = :fatal
  end
end

# The fake LLM, as a Live action.
class StreamsController < ActionController::API
  include ActionController::Live

  EVENT = "data: {\"index\":%d,\"token\":\"lorem\"}\n\n"

  def stream
    count = Integer(params.fetch(:events, 40))
    interval = Integer(params.fetch(:interval_ms, 50)) / 1000.0
    response.headers["content-type"] = "text/event-stream"
    response.headers["cache-control"] = "no-cache"
    StreamGaps.record do |tick|
      due = now
      count.times do |index|
        # A timer may fire a little early: sleep again until the event is due.
        while (left = due - now).positive?
          sleep(left)
        end
        tick.call
        response.stream.write(format(EVENT, index))
        due += interval
      end
    end
  ensure
    response.stream.close
  end

  def ruby
    render plain: NeverBlockBench.ruby_description
  end

  private

  def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
end

# The same events as the action's Rack body: the Rails baseline that Live
# adds to (no Live in this controller: Live runs every action of one).
class BodiesController < ActionController::API
  def body
    # Rails before 8.1 buffers such a body whole (its response's to_ary).
    return head(:not_implemented) if Rails.gem_version < Gem::Version.new("8.1")

    count = Integer(params.fetch(:events, 40))
    interval = Integer(params.fetch(:interval_ms, 50)) / 1000.0
    response.headers["content-type"] = "text/event-stream"
    response.headers["cache-control"] = "no-cache"
    # Rack::ETag buffers a body it can digest, unless the response has a
    # validator: the usual way to stream a body from a Rails action.
    response.headers["last-modified"] = Time.now.httpdate
    self.response_body = Events.new(count, interval)
  end

  # `count` events on a fixed schedule `interval` seconds apart, as `each`.
  class Events
    def initialize(count, interval)
      @count = count
      @interval = interval
    end

    def each
      return enum_for(:each) unless block_given?

      StreamGaps.record do |tick|
        due = now
        @count.times do |index|
          # A timer may fire a little early: sleep again until the event is due.
          while (left = due - now).positive?
            sleep(left)
          end
          tick.call
          yield format(StreamsController::EVENT, index)
          due += @interval
        end
      end
    end

    private

    def now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
  end
end

Rails.application.initialize!

# Drawn after initialize!, which clears routes drawn earlier when there is no config/routes.rb.
Rails.application.routes.draw do
  get "/stream", to: "streams#stream"
  get "/body", to: "bodies#body"
  get "/ruby", to: "streams#ruby"
  get "/stream-gaps", to: ->(_env) { [200, { "content-type" => "text/plain" }, [StreamGaps.report]] }
end

run Rails.application
