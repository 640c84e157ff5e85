# frozen_string_literal: true

module NeverBlock
  class Server
    # The server's span per request (`opentelemetry: true`): kind :server,
    # named by the method (the route is the app's to know), a child of the
    # trace the request's `traceparent` names (the propagators configured),
    # current while the app runs and so the parent of every span the
    # request's fiber and its tasks make. It ends once the response is
    # written (or cut); 5xx answers set its status to error.
    class RequestTracer
      # @raise [ArgumentError] when OpenTelemetry's API is not loaded.
      def initialize
        Telemetry.require_api!("NeverBlock::Server")
        @getter = ::OpenTelemetry::Context::Propagation.rack_env_getter
      end

      # Starts the request's span and runs the block (the app and the
      # response) with it current.
      # @param env [Hash] the Rack env.
      # @param waited [Float] seconds the request waited for admission.
      # @yieldparam span [OpenTelemetry::Trace::Span]
      # @return [Object] the block's value.
      def trace(env, waited)
        parent = ::OpenTelemetry.propagation.extract(env, getter: @getter)
        span = Telemetry.tracer.start_span(env["REQUEST_METHOD"], with_parent: parent, kind: :server,
                                                                  attributes: attributes(env, waited))
        ::OpenTelemetry::Context.with_current(::OpenTelemetry::Trace.context_with_span(span, parent_context: parent)) do
          yield span
        end
      ensure
        span&.finish
      end

      # Records how the request ended.
      # @param span [OpenTelemetry::Trace::Span]
      # @param status [Integer, nil] the status written (nil: none was).
      # @param error [Exception, nil] what the app raised.
      # @return [void]
      def finish(span, status, error)
        span.record_exception(error) if error
        span.set_attribute("http.response.status_code", status) if status
        span.status = ::OpenTelemetry::Trace::Status.error(error&.message || "HTTP #{status}") if error || status.nil? || status >= 500
      end

      private

      def attributes(env, waited)
        attributes = {
          "http.request.method" => env["REQUEST_METHOD"],
          "url.path" => env["PATH_INFO"],
          "url.scheme" => env["rack.url_scheme"],
          "server.address" => env["SERVER_NAME"],
          "server.port" => env["SERVER_PORT"].to_i,
          "network.protocol.version" => env["SERVER_PROTOCOL"].to_s.delete_prefix("HTTP/"),
          "neverblock.admission_wait" => waited.to_f
        }
        query = env["QUERY_STRING"]
        attributes["url.query"] = query unless query.nil? || query.empty?
        (client = env["REMOTE_ADDR"]) && attributes["client.address"] = client
        (agent = env["HTTP_USER_AGENT"]) && attributes["user_agent.original"] = agent
        attributes
      end
    end
  end
end
