# frozen_string_literal: true

module NeverBlock
  # OpenTelemetry, for apps that load it; NeverBlock does not depend on it
  # and pays one `defined?` per spawned task when it is absent.
  #
  # OpenTelemetry keeps its current context per fiber (a stack in a Fiber
  # attribute) and a new fiber starts with none. Left alone, every task an
  # instrumented request spawns would start a trace of its own, and a
  # pooled fiber (FiberPool, the server's requests) would start each block
  # on whatever context the previous block left attached. So:
  #
  # - a task starts with the context current where it was spawned, on a
  #   clean stack, as a thread started by OpenTelemetry's own
  #   instrumentations does (Task, FiberPool);
  # - a block NeverBlock.defer runs on a pool thread does the same (its
  #   spans are children of the waiting fiber's);
  # - within one fiber nothing is needed: the stack stays with the fiber
  #   across its waits, whatever runs in between.
  #
  # On top, two sources of spans that are off by default (an app that
  # already uses opentelemetry-instrumentation-rack or -pg would get each
  # span twice): the server's request span (`opentelemetry: true`, see
  # {RequestTracer}) and the database clients' query spans
  # (`NeverBlock::Postgres.pool(opentelemetry: true)`, the same for MySQL;
  # see {.query_span}).
  module Telemetry
    # Attribute names (OpenTelemetry semantic conventions, HTTP and DB, 1.26+).
    DB_SYSTEM = "db.system"
    DB_OPERATION = "db.operation.name"
    DB_QUERY = "db.query.text"

    # The first SQL keyword, the span's name (SELECT, INSERT, BEGIN, ...).
    OPERATION = /\A\s*(?:--[^\n]*\n\s*|\/\*.*?\*\/\s*)*([a-z]+)/im
    private_constant :OPERATION

    class << self
      # @return [OpenTelemetry::Context, nil] the context a task spawned now
      #   starts with; nil when OpenTelemetry is not loaded.
      def context
        ::OpenTelemetry::Context.current if defined?(::OpenTelemetry::Context)
      end

      # Runs the block with `context` as the calling fiber's (or thread's)
      # only current context, dropping what an earlier block left there.
      # @param context [OpenTelemetry::Context]
      # @return [Object] the block's value.
      def within(context, &block)
        ::OpenTelemetry::Context.clear
        ::OpenTelemetry::Context.with_current(context, &block)
      end

      # @return [Boolean] whether OpenTelemetry's API is loaded, so spans
      #   can be made (the error for `opentelemetry: true` without it).
      def available?
        defined?(::OpenTelemetry::Trace) ? true : false
      end

      # Raises a clear error for `opentelemetry: true` without the API.
      # @param owner [String] what asked for spans, for the message.
      # @return [void]
      # @raise [ArgumentError]
      def require_api!(owner)
        return if available?

        raise ArgumentError, "#{owner}: opentelemetry: true needs OpenTelemetry loaded first " \
                             "(gem \"opentelemetry-sdk\"; require \"opentelemetry/sdk\"; OpenTelemetry::SDK.configure)"
      end

      # @return [OpenTelemetry::Trace::Tracer] NeverBlock's tracer, from the
      #   provider configured now (the SDK's once it is configured).
      #
      # Asked once per statement and per request, so it is kept per
      # provider: the SDK's provider takes a mutex and a Hash lookup for
      # every #tracer call. Keyed by the provider itself, a provider set
      # later (OpenTelemetry.tracer_provider=, as tests do) gets its own; a
      # tracer taken from the API's proxy provider before SDK.configure
      # delegates to the SDK's once it is configured.
      def tracer
        provider = ::OpenTelemetry.tracer_provider
        kept = @tracer # [provider, tracer], replaced whole: safe to read from any thread
        return kept[1] if kept && kept[0].equal?(provider)

        tracer = provider.tracer("neverblock", VERSION)
        @tracer = [provider, tracer].freeze
        tracer
      end

      # Runs a database call in a client span (kind :client) named by its
      # first SQL keyword, a child of the calling fiber's current span.
      # The SQL text is recorded only when `text` is true: a statement sent
      # with parameters holds no values; one with literals may hold
      # personal data, which a trace should not carry by default.
      #
      # @param system [String] "postgresql", "mysql".
      # @param sql [String]
      # @param text [Boolean] whether to record the SQL.
      # @return [Object] the block's value.
      def query_span(system, sql, text:)
        operation = sql[OPERATION, 1]&.upcase
        attributes = { DB_SYSTEM => system }
        attributes[DB_OPERATION] = operation if operation
        attributes[DB_QUERY] = sql if text
        tracer.in_span(operation || system, attributes: attributes, kind: :client) { yield }
      end
    end

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
