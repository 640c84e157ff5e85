# frozen_string_literal: true

require "json"

module NeverBlock
  class Server
    # Answers GET (and HEAD) on one path with the server's {Server#stats} as
    # JSON and passes every other request to the app. The server puts it in
    # front of the app when given `status_path:`.
    class StatusEndpoint
      # @param app [#call] the app behind it.
      # @param stats [#call] returns the Hash to show ({Server#stats}).
      # @param path [String] like `"/_neverblock/status"`.
      def initialize(app, stats, path)
        @app = app
        @stats = stats
        @path = path
      end

      # @param env [Hash] the Rack env.
      # @return [Array] a Rack response.
      def call(env)
        return @app.call(env) unless env["PATH_INFO"] == @path && env["SCRIPT_NAME"].to_s.empty?

        method = env["REQUEST_METHOD"]
        unless method == "GET" || method == "HEAD"
          return [405, { "allow" => "GET, HEAD", "content-type" => "text/plain", "content-length" => "19" },
                  ["method not allowed\n"]]
        end

        body = "#{JSON.generate(@stats.call)}\n"
        [200, { "content-type" => "application/json", "cache-control" => "no-store",
                "content-length" => body.bytesize.to_s }, method == "HEAD" ? [] : [body]]
      end
    end
  end
end
