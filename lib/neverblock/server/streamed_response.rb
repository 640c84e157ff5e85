# frozen_string_literal: true

module NeverBlock
  class Server
    # The lifecycle of a streamed response: a body the server writes while
    # the app still works (`each` without `to_ary`, Rack 3's `call(stream)`,
    # ActionController::Live's body), which may run for as long as the app's
    # call did, or far longer. It ends as a request ends, through the same
    # task tree:
    #
    # - the client hangs up: the {HangupWatch} watches the connection while
    #   the body is written, as while the app's call ran, so a body waiting
    #   between chunks (a query, a sleep, a queue) is cancelled at that wait
    #   within about a second, with {HangupWatch::HungUp}; a write that fails
    #   because the client closed or reset the connection ends it at once
    #   (for `call(stream)`, the {Stream} tells the connection's fiber). Either
    #   way the request is logged 499 and counted as hung up, and what it
    #   spawned (a task writing to the stream, the queries its chunks wait
    #   on) is cancelled when the request ends (Exchange#answer);
    # - `request_timeout`: the writing runs under the request's deadline
    #   (Exchange#write_response);
    # - the server stops: the connection's task is cancelled after
    #   `shutdown_timeout`, its children with it.
    #
    # A `text/event-stream` body gives its request slot back when it starts
    # (Connection#mark_as_io_bound): it only waits for its next event, and an
    # app that streams thousands of them must not need to say so.
    #
    # A write that times out (`write_timeout`: a client still connected but
    # not reading) is not a hang-up: the connection closes and the app's
    # status is logged.
    #
    # Included in {Connection}; called only from Exchange#write_response.
    # It uses the connection's `@context`, `@response`, `@hangup_watch` and
    # sets `@hung_up`, which Exchange reads.
    module StreamedResponse
      # The media type of server-sent events (in any case, with parameters or none).
      EVENT_STREAM = %r{\A[ \t]*text/event-stream[ \t]*(?:;|\z)}i

      private

      # Writes the app's response (Response#write); a streamed body under
      # the hang-up watch (with `cancel_on_hangup`).
      # @return [Boolean] whether the connection may stay open.
      # @raise [HangupWatch::HungUp] the watch saw the client go while the
      #   body was written (`@hung_up` is set).
      # @raise [Response::ClientGone] a write failed (`@hung_up` is set when
      #   the client closed or reset a streamed response's connection).
      def write_body(request, status, headers, body, keep_alive)
        return @response.write(request, status, headers, body, keep_alive) if body.respond_to?(:to_ary)

        # Server-sent events only wait for their next event from here on, as a
        # Live stream does once committed: thousands of open streams must not
        # hold the request slots that new requests need.
        mark_as_io_bound if event_stream?(headers)
        watch = @hangup_watch
        @context.stream_started
        begin
          watch&.watch(self)
          @response.write(request, status, headers, body, keep_alive)
        rescue Response::ClientGone => e
          @hung_up = true unless e.is_a?(Response::WriteTimedOut)
          raise
        ensure
          @context.stream_ended
          watch&.unwatch(self)
        end
      end

      def event_stream?(headers)
        # Rack 2 names headers in any case, and a media type is case-insensitive too.
        type = headers["content-type"] || headers["Content-Type"] || content_type_in_any_case(headers)
        type.is_a?(String) && type.b.match?(EVENT_STREAM) # (bytes: a value need not be valid UTF-8)
      end

      def content_type_in_any_case(headers)
        headers.each { |name, value| return value if name.is_a?(String) && name.casecmp("content-type")&.zero? }
        nil
      end
    end
  end
end
