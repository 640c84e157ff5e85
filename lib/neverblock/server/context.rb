# frozen_string_literal: true

module NeverBlock
  class Server
    # What a {Connection} needs from its server, handed to each one at
    # construction: a {Server} makes one Context (in its #initialize) and
    # gives it to every connection it accepts (`Acceptor#open_connection`), so that a
    # connection depends on this object and never on the Server.
    #
    # It holds what the server configured (the app, the {Limits}, the
    # request slots ({Admission}), the {AccessLog}, the {IdleSweeper}) and
    # the loop's one read buffer, and the serving state both sides use: the
    # server sets {#stopping=}; connections count their requests
    # ({#request_started}, {#request_finished}, read back by
    # {Server#stats}) and report a hijacked socket ({#hijacked}), which the
    # server then stops counting.
    #
    # Not thread-safe: the server and its connections use it from their
    # loop only.
    class Context
      # @return [#call] the Rack app (behind the {StatusEndpoint}, if any).
      attr_reader :app

      # @return [Limits]
      attr_reader :limits

      # @return [Admission] the request slots.
      attr_reader :admission

      # @return [AccessLog, nil]
      attr_reader :access_log

      # @return [Boolean] whether requests get `rack.early_hints`.
      attr_reader :early_hints

      # @return [IdleSweeper] ends idle keep-alive waits (while serving).
      attr_reader :idle_sweeper

      # @return [IdleSet, nil] where idle keep-alive connections wait
      #   without a fiber, while serving (nil: each waits in its fiber; see
      #   {IdleSet.build}).
      attr_accessor :idle_set

      # @return [Handoff, nil] moves keep-alive connections to a less busy
      #   sibling worker, in a worker that takes part (nil otherwise).
      attr_accessor :handoff

      # @return [Integer] connections this worker handed to a sibling.
      attr_reader :handed_off

      # @return [Integer] connections parked in the {IdleSet} to wait their
      #   turn for a next request (Connection::TURN), not idle: they count as
      #   active for the {Handoff}.
      attr_accessor :turns_parked

      # @return [RefusalLog] logs the requests the server refuses itself.
      attr_reader :refusal_log

      # @return [Metrics, nil] what the server counts for its master's
      #   `/metrics` (nil: nothing is counted).
      attr_accessor :metrics

      # @return [String] the loop's read buffer: every connection reads into
      #   it and parses at once, so idle connections hold no buffer.
      attr_reader :read_buffer

      # @return [Boolean] whether connections parse plain heads in C
      #   (Parser.head_parser?, read once).
      attr_reader :head_parser

      # @return [Integer] requests in the app or having their response written.
      attr_reader :requests_in_flight

      # @return [Integer] requests started since the server started.
      attr_reader :requests_total

      # @return [Integer] streamed responses being written (a body the
      #   server writes while the app still works: an event stream, a Live
      #   action's, a relay's), read by {StartPace}.
      attr_reader :streams_open

      # @return [HangupWatch, nil] cancels requests whose client hung up
      #   (nil when `cancel_on_hangup` is off).
      attr_reader :hangup_watch

      # @return [Integer] requests cancelled because their client hung up.
      attr_reader :requests_hung_up

      # @return [HangupLog] logs those requests.
      attr_reader :hangup_log

      # @return [Hijacks] hijacked sockets that tasks of their request serve.
      attr_reader :hijacks

      # @return [Integer] requests that outlived `request_timeout` (answered
      #   503, or cut off if their response had begun).
      attr_reader :requests_timed_out

      # @param app [#call]
      # @param limits [Limits]
      # @param admission [Admission]
      # @param access_log [AccessLog, nil]
      # @param idle_sweeper [IdleSweeper]
      # @param acceptor [Acceptor] told of a {Connection} whose socket the
      #   app took ({Acceptor#hijacked}) or that closed while it was parked
      #   in the {IdleSet}, where no task of its own ends it ({Acceptor#close_connection}).
      # @param early_hints [Boolean] see {Server#initialize}.
      # @param opentelemetry [Boolean] see {Server#initialize}.
      # @param cancel_on_hangup [Boolean] see {Server#initialize}.
      def initialize(app:, limits:, admission:, access_log:, idle_sweeper:, acceptor:, early_hints: false,
                     opentelemetry: false, cancel_on_hangup: true)
        @app = app
        @limits = limits
        @admission = admission
        @access_log = access_log
        @idle_sweeper = idle_sweeper
        @acceptor = acceptor
        @idle_set = nil
        @handoff = nil
        @handed_off = 0
        @turns_parked = 0
        @refusal_log = RefusalLog.new
        @early_hints = early_hints
        @opentelemetry = opentelemetry
        @request_tracer = nil
        @read_buffer = String.new(capacity: Connection::READ_SIZE, encoding: Encoding::BINARY)
        @head_parser = Parser.head_parser? # (an ENV lookup: once, not per connection)
        @requests_in_flight = 0
        @requests_total = 0
        @streams_open = 0
        @requests_timed_out = 0
        @requests_hung_up = 0
        @hangup_log = HangupLog.new
        @hijacks = Hijacks.new
        @hangup_watch = HangupWatch.new if cancel_on_hangup
        @stopping = false
      end

      # @return [Boolean] true once the server is stopping: connections
      #   close after the request they are answering.
      def stopping?
        @stopping
      end

      # @param value [Boolean] set by the server when it begins to stop.
      attr_writer :stopping

      # A connection is about to call the app for a request.
      # @return [void]
      def request_started
        @requests_in_flight += 1
        @requests_total += 1
      end

      # The request's response is written (or given up on).
      # @return [void]
      def request_finished
        @requests_in_flight -= 1
      end

      # A streamed response's body begins to be written.
      # @return [void]
      def stream_started
        @streams_open += 1
      end

      # ... and is written, or given up on.
      # @return [void]
      def stream_ended
        @streams_open -= 1
      end

      # The request spans' maker, made at the first request (a worker loads
      # the app, and with it OpenTelemetry, after the server was made).
      # Without OpenTelemetry's API loaded by then it says so once and
      # makes no spans.
      # @return [RequestTracer, nil]
      def request_tracer
        return unless @opentelemetry
        return @request_tracer if @request_tracer

        @request_tracer = RequestTracer.new
      rescue ArgumentError => e
        @opentelemetry = false
        NeverBlock.logger.error("#{e.message}; serving without request spans")
        nil
      end

      # Offers a connection waiting for its next request to a less busy
      # sibling worker ({Handoff#hand_off}); counts it when one took it.
      # @param io [Socket] its socket.
      # @param listener [Listener]
      # @return [Boolean] whether it was handed on (the caller then ends the
      #   connection here without a word to the client).
      def hand_off(io, listener)
        return false unless @handoff && !@stopping && @handoff.hand_off(io, listener, Clock.now)

        @handed_off += 1
        true
      end

      # A request was cancelled because its client hung up.
      # @return [void]
      def request_hung_up
        @requests_hung_up += 1
      end

      # A request outlived `request_timeout`.
      # @return [void]
      def request_timed_out
        @requests_timed_out += 1
      end

      # The app took the connection's socket (rack.hijack): it is no longer
      # the server's to count, and the server will not close it.
      # @param connection [Connection]
      # @return [void]
      def hijacked(connection)
        @acceptor.hijacked(connection)
      end

      # A parked connection was closed (see {Connection#close_if_idle}):
      # the server closes its socket and stops counting it.
      # @param connection [Connection]
      # @return [void]
      def connection_closed(connection)
        @acceptor.close_connection(connection)
      end
    end
  end
end
