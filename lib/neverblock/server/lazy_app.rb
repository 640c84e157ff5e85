# frozen_string_literal: true

module NeverBlock
  class Server
    # A Rack app built by a block on first need: at once in a master that
    # preloads, or in each forked worker (`on_worker_boot: ->(_) { app.build }`),
    # so that what the app opens (connections, files) belongs to the worker.
    #
    #   app = NeverBlock::Server::LazyApp.new { Rack::Builder.parse_file("config.ru") }
    #   NeverBlock::Server.new(app, workers: 4, on_worker_boot: ->(_index) { app.build })
    class LazyApp
      # @yieldreturn [#call] the app.
      def initialize(&builder)
        raise ArgumentError, "LazyApp.new needs a block that builds the app" unless builder

        @builder = builder
        @app = nil
      end

      # Builds the app now, once.
      # @return [#call]
      def build
        @app ||= @builder.call
      end

      # @return [Boolean] whether {#build} has built it (in this process or
      #   in the one it was forked from).
      def built?
        !@app.nil?
      end

      # @param env [Hash]
      # @return [Array] the app's response.
      def call(env)
        (@app || build).call(env)
      end
    end
  end
end
