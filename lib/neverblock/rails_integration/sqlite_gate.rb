# frozen_string_literal: true

require_relative "../semaphore"

module NeverBlock
  module RailsIntegration
    # Lets at most a few requests into a Rails app whose database is SQLite
    # at once, under NeverBlock's server; the others wait their turn before
    # the app, as requests wait for one of Puma's threads.
    #
    # Why: SQLite runs inside the process. Its queries hold the event loop
    # (there is no socket to wait on), so concurrent requests gain nothing
    # there, and it takes one writer at a time: the others wait inside
    # SQLite's busy handler, whose clock (database.yml's `timeout:`, 5 s in
    # a generated app) runs from the moment each entered. With every
    # request in the app at once, twenty requests that each write in a 0.3 s
    # transaction all queued inside SQLite, and the last three failed with
    # `SQLite3::BusyException: database is locked` after 5 s; Puma's three
    # threads kept the rest outside and served all twenty.
    #
    # When: the app's primary database for its environment has the
    # `sqlite3` adapter, in a process of {Server} ({RailsIntegration.before_serving}
    # calls {.configure}, which logs one line saying so). Under another server
    # the gate lets every request through. `NEVERBLOCK_SQLITE_REQUESTS` sets
    # the number ({DEFAULT}), or `off`.
    #
    # The {Railtie} puts it last in the app's middleware, right before the
    # routes: static files and the middleware before it are not held. A
    # request holds its place until the app returns its response (a
    # streamed body is written after the place is given back).
    class SqliteGate
      # The environment variable: a number of requests, or `off`.
      SWITCH = "NEVERBLOCK_SQLITE_REQUESTS"

      # Requests in the app at once by default: the pool size a generated
      # database.yml gives without RAILS_MAX_THREADS.
      DEFAULT = 5

      class << self
        # @return [Semaphore, nil] this process's gate, nil when requests
        #   go through ungated.
        attr_reader :semaphore

        # Opens or closes the gate for this process from the app's
        # ActiveRecord configurations (its environment's, first the primary).
        # @param configs [Array<ActiveRecord::DatabaseConfigurations::DatabaseConfig>]
        # @param env [String] the environment, for the log line.
        # @return [Semaphore, nil] the gate, nil when off.
        # @raise [ArgumentError] for a NEVERBLOCK_SQLITE_REQUESTS that is
        #   neither a positive number nor `off`.
        def configure(configs, env)
          @semaphore = nil
          primary = configs.first
          return unless primary && primary.adapter.to_s == "sqlite3"

          limit = limit_from(ENV.fetch(SWITCH, nil)) or return
          @semaphore = Semaphore.new(limit)
          NeverBlock.logger.info("NeverBlock::Server: ActiveRecord database #{primary.name.inspect} (#{env}) is " \
                                 "SQLite, which holds the event loop during queries and takes one writer at a " \
                                 "time: at most #{limit} requests run in the app at once, the rest wait before it " \
                                 "(#{SWITCH}=N or off to change it; docs/rails.md, SQLite)")
          @semaphore
        end

        # Closes the gate (every request goes through).
        # @return [void]
        def reset
          @semaphore = nil
        end

        private

        def limit_from(value)
          return DEFAULT if value.nil? || value.strip.empty?
          return nil if value.strip.casecmp?("off")

          limit = Integer(value.strip, exception: false)
          return limit if limit&.positive?

          raise ArgumentError, "#{SWITCH} must be a positive number of requests or off; got #{value.inspect}"
        end
      end

      # @param app [#call] the rest of the Rails middleware and the routes.
      def initialize(app)
        @app = app
      end

      # Rack: calls the app, after waiting for a place when the gate is on.
      # @param env [Hash]
      # @return [Array] the app's response.
      def call(env)
        semaphore = SqliteGate.semaphore
        return @app.call(env) unless semaphore

        semaphore.acquire { @app.call(env) }
      end
    end
  end
end
