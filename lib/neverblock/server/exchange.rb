# frozen_string_literal: true

module NeverBlock
  class Server
    # One request's exchange, the second half of a {Connection}'s work (as
    # Puma's request.rb is its server's): calling the app for a request whose
    # head the connection read and whose request slot it holds, under
    # `request_timeout` when set, and writing the response (or the 503 of a
    # request that outlived it), with the hijacks, early hints, the access
    # log and the request's span on the way. Included in {Connection} and
    # called only from its request loop (Connection#serve_requests, through
    # #answer); it uses the connection's state (`@context`, `@socket`,
    # `@response`, `@hijacked`...) and gives nothing back but #answer's
    # answer: whether the connection stays open.
    module Exchange
      # Seconds a client is told to wait (Retry-After) before it retries a
      # request answered 503 for outliving `request_timeout`: the server is
      # not down, that request was slow, and one second spreads the retries
      # of a burst without making a user wait long.
      RETRY_AFTER = 1

      private

      # The `rack.early_hints` callable (Rack 3; Rails' `request.send_early_hints`):
      # sends `103 Early Hints` with `headers` at once, ahead of the final
      # response. Only while the app's call runs (after it, the response is
      # being written) and the socket is still the server's; HTTP/1.0
      # requests do not have the key ({Parser}).
      # @param headers [Hash{String => String, Array<String>}]
      # @return [nil]
      # @raise [ArgumentError] for a header name that is not an HTTP token or
      #   a value with CR, LF or NUL (nothing is written).
      def early_hints(headers)
        @response.write_early_hints(headers) if @app_env && !@hijacked
        nil
      end

      # Calls the app for one request and writes its response. What the app
      # spawned and left running is cancelled once the response is written
      # (Task::Tree), unless the app took the socket over.
      # @return [Boolean] whether the connection stays open.
      def answer(request)
        @answered = @just_answered = true
        task = Thread.current[Task::Tree::CURRENT] # Task.current, without its call
        mark = task.spawned if task
        @app_task = task # the one HangupWatch cancels, while it watches the connection
        env = request.complete_env
        @context.request_started
        access_log = @context.access_log
        metrics = @context.metrics
        started = Clock.now if access_log || metrics
        line = access_log.start(env) if access_log
        @status = nil # what the access log shows: set once the response is known
        deadline = (request.head_at + @request_timeout if @request_timeout)
        if (tracer = @context.request_tracer)
          traced(tracer, request, env, deadline)
        elsif deadline
          respond(request, env, deadline)
        else
          call_and_write(request, env, nil) # #respond's first line, one call fewer per request
        end
      ensure
        @app_task = nil
        task.reap(mark, "ended: its request is over") if task&.reapable?(mark) && !@hijacked
        @context.hijacks.adopt(app_io, @io, task, mark, env, deadline, @hung_up) if @hijacked && task
        @context.request_finished
        metrics.request(env["REQUEST_METHOD"], @status, Clock.now - started) if metrics && started
        if line && (status = @status)
          bytes = @hijacked ? "-" : @response.body_bytes
          access_log.write(env["REMOTE_ADDR"], line, status, bytes, Clock.now - started, @waited)
        end
        @waited = 0.0
      end

      # #respond inside the request's span (`opentelemetry: true`).
      def traced(tracer, request, env, deadline)
        tracer.trace(env, @waited) do |span|
          @traced = true
          keep_alive = respond(request, env, deadline)
          tracer.finish(span, @status, @app_error)
          keep_alive
        ensure
          @traced = false
          @app_error = nil
        end
      end

      # The app's call, then its response. With a `deadline` (monotonic
      # seconds, from `request_timeout`) each runs under it: the app's call
      # and the writing of its body are unwound at their first wait past it
      # ({RequestTimeout}), and the request is answered 503 (see {#timed_out}).
      # A request whose deadline passed before the app was called (it waited
      # that long for a slot, or for its body) is answered 503 without it.
      # An expiry the app (or its body) rescued is logged and counted all
      # the same, once, and the app's answer is what is sent
      # (#timeout_rescued).
      def respond(request, env, deadline)
        return call_and_write(request, env, nil) unless deadline

        @response.started = false # not the last request's response: nothing of this one's is sent yet
        return timed_out(request, env, nil) if deadline <= Clock.now

        expiry = (@request_expiry ||= RequestExpiry.new).clear
        keep_alive = call_and_write(request, env, deadline)
        timeout_rescued(request, env) if expiry.error # #timed_out clears the expiries it reports
        keep_alive
      end

      # #respond's work: the app's call, then its response.
      def call_and_write(request, env, deadline)
        watch = nil
        begin
          @app_env = env
          (watch = @hangup_watch)&.watch(self)
          status, headers, body = deadline ? before(deadline) { @context.app.call(env) } : @context.app.call(env)
        rescue StandardError => e
          return hung_up(env, nil, e) if @hung_up
          raise if e.is_a?(Cancelled)
          return timed_out(request, env, e) if deadline && expiry?(e)

          app_failed(e, env)
          return response_finished(env, nil, nil, e) && false if @hijacked # the socket is the app's, even now

          @status = 500
          keep_alive = request.keep_alive && !@context.stopping?
          @response.write_error(500, keep_alive: keep_alive, head: request.head)
          return response_finished(env, 500, {}, e) && keep_alive
        ensure
          @app_env = nil
          watch&.unwatch(self)
        end
        return hung_up(env, body, framework_error(env)) if @hung_up
        if deadline && expiry?(framework_error(env))
          close_body(body, env) # an error page for the expiry, not an answer of the app's
          return timed_out(request, env, framework_error(env))
        end
        @status = status
        if @hijacked
          close_body(body, env)
          return response_finished(env, status, headers, nil) && false
        end

        keep_alive = request.keep_alive && !@context.stopping? # a stop during the app closes after it
        # An app that answered past its deadline (it rescued the expiry, or
        # computed past it without waiting) has its answer written, bounded
        # by write_timeout only.
        deadline = nil if deadline && deadline <= Clock.now
        write_response(request, env, status, headers, body, keep_alive, deadline)
      end

      # Runs the block until `deadline`: past it, its next wait raises a
      # {RequestTimeout} (made only then, by the connection's
      # {RequestExpiry}, which keeps it: a request in time allocates none).
      def before(deadline, &block)
        Fiber.scheduler.timeout_after(deadline - Clock.now, @request_expiry, @request_timeout, &block)
      end

      # @return [Exception, nil] the exception a framework rendered its own
      #   error page for (Rails' ShowExceptions, Sinatra), when it says so in
      #   the env. Rails renders a 500 page for any exception, the expiry
      #   included: that is no answer of the app's to its timeout, so the
      #   server answers 503 instead.
      def framework_error(env)
        env["action_dispatch.exception"] || env["sinatra.error"]
      end

      # Whether `error` is a {RequestTimeout}, or wraps one (a library that
      # rescued it and raised its own error, with it as the cause). Only
      # this request's deadline raises one in its fiber (an app's own
      # NeverBlock.timeout raises another class).
      def expiry?(error)
        return false unless error

        4.times do
          return true if error.is_a?(RequestTimeout)

          error = error.cause or return false
        end
        false
      end

      # The request outlived `request_timeout` (`error` is the expiry; nil
      # when the app was not called): one warning, a count in the stats,
      # and a 503 with Retry-After and `connection: close` if no byte of the
      # response was sent; otherwise the connection just closes (the client
      # sees a cut response, not a complete wrong one).
      # @return [false] the connection closes.
      def timed_out(request, env, error)
        count_timeout(request, env, error ? "" : " before the app was called")
        @request_expiry&.clear # reported: #respond does not report it again
        return response_finished(env, nil, nil, error) && false if @hijacked

        unless @response.started
          @status = 503
          @response.write_error(503, head: request.head, retry_after: RETRY_AFTER)
        end
        response_finished(env, @status, {}, error)
        false
      end

      # The request's deadline raised its expiry in the app (or in its
      # body's each) and the app rescued it and answered itself: its answer
      # is sent (it is, by now), and the timeout is logged and counted as
      # every other one.
      # @return [void]
      def timeout_rescued(request, env)
        count_timeout(request, env, "; the app rescued the expiry and answered #{@status || 'nothing'}")
      end

      # One warning and a count in the stats (`requests_timed_out`, in
      # /metrics `neverblock_request_timeouts_total`) for a request that
      # outlived `request_timeout`; `note` ends the log line.
      def count_timeout(request, env, note)
        NeverBlock.logger.warn("NeverBlock::Server: #{env['REQUEST_METHOD']} #{env['PATH_INFO']} timed out after " \
                               "#{(Clock.now - request.head_at).round(3)} s (request_timeout #{@request_timeout} s, " \
                               "pid #{Process.pid})#{note}")
        @context.request_timed_out
      end

      # The client hung up while the app handled its request (HangupWatch),
      # or `during` its streamed response (StreamedResponse): nothing more is
      # written, the access log shows 499, one line is logged (HangupLog),
      # and the connection closes. An app that rescued the cancel and
      # answered anyway has its answer dropped the same way.
      # @return [false]
      def hung_up(env, body, error, during = "while the app handled it")
        close_body(body, env) if body
        @context.request_hung_up
        @status = 499
        @context.hangup_log.hung_up(env, during)
        response_finished(env, nil, nil, error || HangupWatch::HungUp.new)
        false
      end

      # Writes the app's response; with a `deadline`, the writing (the
      # body's each or call(stream)) is unwound at its first wait past it.
      # Closing the body and the rack.response_finished callbacks run
      # without it (Rails releases its database connections there), and so
      # does a partial hijack (the socket is the app's).
      def write_response(request, env, status, headers, body, keep_alive, deadline)
        error = nil
        expired = false
        begin
          if (hijack = headers["rack.hijack"])
            partial_hijack(hijack, status, headers)
            keep_alive = false
          elsif deadline
            keep_alive = before(deadline) { write_body(request, status, headers, body, keep_alive) }
          elsif body.respond_to?(:to_ary)
            keep_alive = @response.write(request, status, headers, body, keep_alive) # #write_body's first case, inline
          else
            keep_alive = write_body(request, status, headers, body, keep_alive)
          end
        rescue Response::ClientGone => e
          error = e
          keep_alive = false
        rescue StandardError => e
          raise if e.is_a?(Cancelled) && !@hung_up # (@hung_up: the HangupWatch cancelled a streamed body)

          error = e
          keep_alive = false
          # Under request_timeout, the body's each or call(stream) waited past the deadline.
          expired = deadline && expiry?(e)
          unless expired || @hung_up
            app_failed(e, env)
            # Before the first byte a clean 500 is still possible; after it, only
            # closing the connection tells the client the response is incomplete.
            @response.write_error(500, head: request.head) unless @response.started
          end
        ensure
          close_body(body, env)
          response_finished(env, status, headers, error) unless expired || @hung_up
        end
        return hung_up(env, nil, error, "during its streamed response") if @hung_up
        expired ? timed_out(request, env, error) : keep_alive
      end

      # The Rack partial hijack (a `rack.hijack` response header): the status
      # line and headers go out as the app gave them (no framing added), then
      # the callback gets the socket, which from then on is the app's.
      def partial_hijack(callback, status, headers)
        @response.write_head(status, headers)
        take_over
        callback.call(app_io)
      end

      def take_over
        @hijacked = true
        @context.hijacked(self)
      end

      def close_body(body, env)
        body.close if body.respond_to?(:close)
      rescue StandardError => e
        app_failed(e, env)
      end

      # Runs rack.response_finished callbacks (Rack 3.1).
      def response_finished(env, status, headers, error)
        env["rack.response_finished"]&.reverse_each do |callback|
          callback.call(env, status, headers, error)
        rescue StandardError => e
          app_failed(e, env)
        end
        true
      end

      # What the app gets from a hijack: the socket, or for TLS the
      # OpenSSL::SSL::SSLSocket (an IO-like object that encrypts).
      def app_io
        @listener.tls ? @socket.ssl : @socket
      end

      def app_failed(error, env)
        @app_error = error if @traced
        NeverBlock.logger.error("NeverBlock::Server: #{env['REQUEST_METHOD']} #{env['PATH_INFO']} failed: " \
                                "#{error.class}: #{error.message}\n#{(error.backtrace || []).join("\n")}")
      end
    end
  end
end
