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
  # {Server::RequestTracer}) and the database clients' query spans
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
  end
end
