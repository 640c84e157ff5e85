# frozen_string_literal: true

module NeverBlock
  class Server
    # One client connection, served in tasks of the server's FiberPool:
    # reads, parses, calls the app for each request in order (pipelined
    # requests included) and keeps the connection open while HTTP and the
    # server allow. {Server}'s accept loop makes one per accepted socket
    # (`Server#serve`) and calls {#run} in a pooled task; the {IdleSweeper}
    # calls {#expire_idle}, and {Server#stop} {#close_if_idle}. All it uses
    # of its server comes in a {Context}.
    #
    # Waiting for its next request with nothing of it read, the connection
    # holds no fiber for long where the server has an {IdleSet} (Linux):
    # after a sweep interval of waiting in its fiber (at once when many
    # wait so), its task parks it there and ends ({#parked?}), and when its
    # socket turns readable the server calls {#resume} in a new task.
    # Otherwise (no IdleSet, a TLS connection with decrypted bytes pending,
    # a stopping server) its fiber waits on the socket.
    #
    # From the end of a request's head until the connection is idle again
    # (its requests answered, nothing more read) it holds one of the
    # server's `fiber_pool` request slots. Waiting for its next request, and
    # reading that request's head (bounded by `max_header_bytes` and
    # `header_timeout`), it holds none: clients that trickle partial heads
    # (slowloris) take no request slot from complete requests, and do not
    # stop the server accepting. A complete head waits for a slot before its
    # body is read and the app is called. A request whose app calls
    # `env["neverblock.mark_as_io_bound"]` ({Server::MARK_AS_IO_BOUND}) gives
    # its slot back there and is answered without one: from then on it only
    # waits (a debouncer follower, a long poll, a stream), which costs the
    # loop nothing, so it must not hold back new arrivals. A pipelined request
    # after it acquires a slot again.
    #
    # Under `request_timeout` ({Limits}) a request is served against a
    # deadline counted from the end of its head: the app's call and the
    # writing of its response run under the scheduler's `timeout_after`,
    # which raises a {RequestTimeout} at their first wait past it, and the
    # request is answered 503 (see #respond and #timed_out).
    class Connection
      # Bytes read from the socket at a time.
      READ_SIZE = 16 * 1024

      # A refused request's connection is drained of what the client is still
      # sending for at most this long (seconds) and this many bytes, so the
      # client sees the error response and not a reset.
      LINGER_SECONDS = 1
      LINGER_BYTES = 1024 * 1024

      GONE = Response::GONE
      private_constant :GONE

      # The Rack env key of the early-hints callable.
      EARLY_HINTS = "rack.early_hints"

      # A request that took this long (seconds, from its slot to its
      # response) or longer does not have its connection's next request
      # read at once, even if it is there: the connection waits its turn
      # behind the connections that turned readable before it, parked in the
      # {IdleSet} where there is one (#read_next_request). Otherwise a keep-alive client that sends its
      # next request as soon as it has a response (a proxy, a benchmark)
      # finds it read and served inline, again and again, while the other
      # connections' requests sit unread in their sockets: ten clients of
      # 20 ms pages saw waits of over a second where their fair share was
      # 200 ms. Requests shorter than this (a fast page, a health check) keep
      # the inline read, which saves a selector round trip each.
      TURN = 0.001

      # Seconds a client is told to wait (Retry-After) before it retries a
      # request answered 503 for outliving `request_timeout`: the server is
      # not down, that request was slow, and one second spreads the retries
      # of a burst without making a user wait long.
      RETRY_AFTER = 1

      # @return [Task, nil] the task serving it (set by the server once its
      #   spawn returns, which is at the connection's first wait); the last
      #   one while it is parked.
      attr_accessor :task

      # @return [Fiber, nil] the fiber serving it, from its task's start;
      #   nil while it is parked (and until a resuming task starts).
      attr_reader :fiber

      # @param context [Context] its server's app, limits, request slots...
      # @param socket [Socket] an accepted client socket.
      # @param listener [Listener] that accepted it.
      def initialize(context, socket, listener)
        @context = context
        @admission = context.admission # on every request's path: one read, not two
        @socket = socket
        @io = socket # the accepted socket (@socket becomes a TLS one)
        @listener = listener
        @idle = false
        @idle_deadline = nil
        @slot = false
        @waited = 0.0 # seconds the request being answered waited for its slot
        @app_env = nil # the env of the request the app is handling, while it does
        @hijacked = false
        @parked = false
        @answered = false # a response was written: the next request's wait tells how busy its client is
        @brisk = false # its last next request came soon (see #came_back_soon?)
        @slot_at = nil # when it took its request slot (monotonic seconds; see TURN)
        @turn = false # parked waiting its turn, not idle (see #park)
        @wait_cut = false # a wait on the socket was cut short (see #movable?)
      end

      # Serves requests until the client or HTTP ends the connection, an
      # error closes it, the server stops, or it parks ({#parked?}: then
      # {#resume} goes on). Does not close the socket.
      # @return [void]
      def run
        @fiber = Fiber.current
        # Responses go out in as few writes as possible; Nagle would only delay them.
        @socket.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1) unless @listener.unix?
        limits = @context.limits
        @limits = limits
        @request_timeout = limits.request_timeout
        if @listener.tls # the handshake, like a request head, holds no request slot
          @socket = @listener.secure(@socket, Clock.now + limits.header_timeout)
          return unless @socket
        end
        @parser = Parser.new(limits, base_env, @listener.unix? ? "localhost" : local_host, (@listener.port || 0).to_s)
        @response = Response.new(@socket, limits.write_timeout)
        serve_requests
      rescue Response::ClientGone, SystemCallError, IOError
        nil # the client went away (or reset the connection before we started)
      end

      # Goes on serving a parked connection whose socket turned readable
      # (the server calls it in a new task; see {#run}).
      # @return [void]
      def resume
        @fiber = Fiber.current
        serve_requests
      end

      # @return [Boolean] true while it waits for its next request in the
      #   server's {IdleSet}, with no task: the task that parked it ended
      #   without closing it.
      def parked?
        @parked
      end

      # The {IdleSet} took it out (its socket is readable): a task is about
      # to {#resume} it, unless it is handed on ({#hand_off}).
      # @return [Boolean] whether it was parked waiting its turn (see {#park}):
      #   only such a connection may be handed on.
      def unpark
        @parked = false
        end_turn_park
      end

      # A connection parked to wait its turn that is still parked a sweep
      # interval later (the {IdleSweeper} says so) is idle: it no longer
      # counts as active for the {Handoff}.
      # @return [void]
      def settle
        end_turn_park
      end

      # Offers the connection, just out of the {IdleSet} where it waited its
      # turn (call it only when {#unpark} said so), with nothing of its next
      # request read, to a less busy sibling worker ({Handoff}). Only such a
      # connection: it parked straight after a request whose waits on the
      # socket all ended, so the selector holds no registration of it (epoll
      # keeps one while any process holds the socket: a socket moved while
      # registered here would go on reporting here, under a descriptor number
      # the next accept reuses, and the loop would spin). A connection the
      # {IdleSweeper} parked from a wait in its fiber may still be registered
      # (a cancelled wait leaves it until the socket's next event), so it
      # stays. The socket leaves the IdleSet's own set before it goes.
      # @return [Boolean] whether a sibling took it: the server then closes
      #   this process's descriptor, and the client's connection stays open.
      def hand_off
        return false unless movable? && @context.hand_off(@io, @listener)

        @context.idle_set.forget(@io.fileno)
        true
      end

      # Closes the socket, unless the app took it (rack.hijack) or it is
      # closed already.
      # @return [void]
      def close
        @io.close unless @io.closed? || @hijacked
      end

      # @return [Boolean] true while it waits for the first bytes of its next
      #   request, holding no slot.
      def idle?
        @idle
      end

      # The Rack full hijack (`env["rack.hijack"].call`): from now on the
      # socket is the app's. The server no longer counts the connection,
      # ignores the app's response, and never reads, writes or closes the
      # socket (not even when the app raises, nor on {Server#stop}).
      #
      # Only the request being answered may take the socket, while the app
      # handles it, and only if the client sent nothing after it yet: bytes
      # already read from the socket could not reach the app. An Upgrade or
      # CONNECT request always qualifies (see {Parser}).
      #
      # The app may serve the socket in the request's own fiber (which holds
      # a connection slot until it returns) or in a task it spawns (which
      # keeps {Server#run} from returning until it ends: close such sockets
      # when the server stops). Also sets `rack.hijack_io`.
      # @return [Socket]
      # @raise [Error] when called outside the app's `call`, or when the
      #   client already pipelined more bytes after the request.
      def hijack
        return app_io if @hijacked
        raise Error, "rack.hijack can only be called inside the app's call(env)" unless @app_env
        if @parser.in_message? || !@parser.requests.empty?
          raise Error, "rack.hijack refused: the client already sent more bytes after this request (pipelining), " \
                       "which the app could not read from the socket; hijack Upgrade requests, or answer this one normally"
        end

        take_over
        @app_env["rack.hijack_io"] = app_io # Rack 2's way, still read by some WebSocket libraries
        app_io
      end

      # @return [Hash, nil] the env of the request the app is handling, while
      #   it is (for {TaskDump}).
      def request_env
        @app_env
      end

      # @return [Boolean] true once the app took the socket (full or partial
      #   hijack): the server must not close it.
      def hijacked?
        @hijacked
      end

      # Ends the connection now if it is waiting for a next request (for
      # {Server#stop}); one in the middle of a request is left to finish.
      # @return [void]
      def close_if_idle
        if @parked
          closed_while_parked
        elsif @idle && @fiber # (not a resuming task that has not started: it has bytes to read)
          @task&.cancel
        end
      end

      # @return [Float, nil] when its wait for a next request times out
      #   (monotonic seconds), while it waits on the socket for one.
      attr_reader :idle_deadline

      # @api private
      # Parks the connection if its fiber waits for a next request and it
      # may park (see #park?): the {IdleSweeper} calls it once the wait
      # lasted a sweep interval. Its task then ends, and the fiber goes back
      # to the pool.
      # @return [void]
      def park_idle
        Fiber.scheduler.interrupt(@task, IdleSweeper::Park.new) if @idle && @fiber && @task && !@parked && park?
      end

      # @api private
      # Ends its wait for a next request if {#idle_deadline} is `now` or
      # earlier (the {IdleSweeper}); the connection then closes.
      # @param now [Float] monotonic seconds.
      # @return [void]
      def expire_idle(now)
        deadline = @idle_deadline
        return unless deadline && deadline <= now

        if @parked
          closed_while_parked
        elsif @fiber && @task
          Fiber.scheduler.interrupt(@task, IdleSweeper::Expired.new)
        end
      end

      private

      # Reads, parses and answers requests (see {#run}).
      def serve_requests
        requests = @parser.requests
        loop do
          data = read_more or return
          error = nil
          begin
            @parser << data
          rescue HTTPError => e
            error = e
          end
          acquire_slot unless @slot || requests.empty?

          while (request = requests.first)&.complete
            requests.shift
            acquire_slot unless @slot # the request before it was marked IO-bound
            begin
              keep_open = serve(request)
            ensure
              request.close # a spooled body's file
            end
            return unless keep_open
          end
          return refuse(error) if error
          return if @context.stopping? && !@parser.in_message?

          if (request = requests.first)&.expects_continue
            request.expects_continue = false
            @response.write_continue
          end
        end
      rescue Response::ClientGone, SystemCallError, IOError
        nil # the client went away
      ensure
        @parser&.requests&.each(&:close) # refused or cut short: their spooled bodies
        release_slot
      end

      # @return [String, nil] the next bytes, or nil when the connection
      #   should just be closed (EOF, idle timeout).
      # @raise [HTTPError] 408 when a request is too slow.
      def read_more
        return read_next_request unless @parser.in_message?

        if @parser.in_body?
          timeout = @limits.body_timeout
          slow = "no request body for #{timeout} s"
        else
          timeout = @parser.started_at + @limits.header_timeout - Clock.now
          slow = "headers not complete within #{@limits.header_timeout} s"
        end
        buffer = @context.read_buffer
        loop do
          data = @socket.read_nonblock(READ_SIZE, buffer, exception: false)
          return data unless data == :wait_readable
          next if timeout.positive? && @socket.wait_readable(timeout)

          refuse(HTTPError.new(408, slow))
          return nil
        end
      end

      # Waits (idle) for the first bytes of the next request, for at most
      # `idle_timeout` seconds, holding no request slot. The wait has no
      # timer of its own: the server's {IdleSweeper} ends it at
      # {#idle_deadline}, and parks the connection ({#park_idle}) once it
      # has waited one sweep interval: a client that sends its next request
      # at once (a busy keep-alive connection) finds its fiber still
      # waiting, which costs less than a park and a new task. Beyond
      # {IdleSet::WAITING_FIBERS} such waits a brisk connection (its last
      # next request came soon, see #came_back_soon?) waits a few
      # milliseconds ({BriefWaits}) and then parks, and any other parks at
      # once, so that many connections going idle together (a burst) do not
      # hold as many fibers, whose stack pages Ruby keeps resident once
      # touched.
      # @return [String, nil] the bytes, nil on EOF or idle timeout, or
      #   when it parked ({#parked?}).
      def read_next_request
        took_turn = release_slot

        @idle = true
        buffer = @context.read_buffer
        data = took_turn ? :wait_readable : @socket.read_nonblock(READ_SIZE, buffer, exception: false)
        unless data == :wait_readable
          @brisk = came_back_soon? if @answered
          return data
        end

        # A resumed connection that found no request (TLS: part of a record)
        # keeps the deadline it parked with.
        @idle_deadline ||= Clock.now + @limits.idle_timeout
        @context.idle_sweeper.watch(self)
        if (idle_set = @context.idle_set)
          # Its turn is taken in the order requests arrive: parked, its socket
          # reports once it is readable (one-shot), behind those that turned
          # readable before it. A wait in the selector would not keep that
          # order: epoll reports a level-triggered socket in the order of its
          # previous report, so the connection answered last in a round, whose
          # next request had not come yet when the loop looked, then waited
          # most of two rounds (ten clients of 20 ms pages: p99 163 ms, 100 in
          # turn).
          return park(turn: true) if took_turn && park?

          if idle_set.crowded? && park?
            return park unless @brisk

            (brief = idle_set.brief_waits).add(self)
          else
            idle_set.fiber_waits += 1
            counted = true
          end
        end
        while true # rubocop:disable Style/InfiniteLoop -- Kernel#loop adds a C frame to every idle fiber's stack
          begin
            @socket.wait_readable
            data = @socket.read_nonblock(READ_SIZE, buffer, exception: false) # (TLS may wait to write)
          rescue IdleSweeper::Park
            @wait_cut = true
            return park if park?

            next
          end
          next if data == :wait_readable

          @brisk = came_back_soon? if @answered
          return data
        end
      rescue IdleSweeper::Expired
        nil
      rescue IdleSweeper::Park # at a TLS write in the first read of a resumed connection
        @wait_cut = true
        park? ? park : nil
      ensure
        idle_set.fiber_waits -= 1 if counted
        brief&.delete(self)
        unless @parked
          @idle = false
          @idle_deadline = nil
        end
      end

      # Whether a sibling worker could take the connection over ({Handoff}):
      # a plain socket (a TLS session cannot leave this process) that the
      # app did not take, and whose waits on the socket all ended with an
      # event: one cut short (the {IdleSweeper} parking it) leaves the
      # selector's level-triggered registration behind until the socket's
      # next event, which the connection may read before the selector looks
      # (see {#hand_off}), so such a connection never moves.
      def movable?
        !@listener.tls && !@hijacked && !@wait_cut
      end

      # Whether the wait for the next request may end the connection's task
      # (see {IdleSet}): the server has an idle set and is not stopping
      # (a stopping server's idle waits are cancelled by its tasks), the app
      # did not take the socket, and TLS holds no decrypted bytes, which
      # the socket's readability would not announce. Nothing of the next
      # request is read: it waits at a message boundary with no pipelined
      # request left.
      def park?
        @context.idle_set && !@context.stopping? && !@hijacked && !(@listener.tls && @socket.ssl.pending.positive?)
      end

      # Whether the wait for the next request that just ended (with bytes)
      # was short: none at all, or shorter than a sweep interval (the time a
      # connection may wait in its fiber before it parks). Beyond
      # {IdleSet::WAITING_FIBERS} fiber waits only such a brisk connection
      # waits briefly ({BriefWaits}) for its next request; the others park
      # at once, so that connections that made one request and went idle (a
      # burst of new clients) return their fibers to the pool at once and
      # the next ones reuse them, rather than making new fibers, whose
      # stacks Ruby keeps until a GC frees them (10,000 such connections
      # took 18.7 KB each instead of 4).
      def came_back_soon?
        deadline = @idle_deadline or return true

        Clock.now - deadline + @limits.idle_timeout < @context.idle_sweeper.interval
      end

      # Parks the connection in the server's {IdleSet}: its task ends, and
      # {#resume} goes on in another once the socket is readable. `turn`:
      # it waits its turn for a next request on its way, not idle
      # ({Context#turns_parked} counts it among the active connections).
      def park(turn: false)
        @context.idle_set.park(self, @io.fileno)
        if turn
          @turn = true
          @context.turns_parked += 1
        end
        @parked = true
        @brisk = false
        @fiber = nil
        nil
      end

      # Closes a parked connection (idle timeout, stop): out of the set, then
      # what the end of its task would have done.
      def closed_while_parked
        @context.idle_set.unpark(@io.fileno)
        @parked = false
        end_turn_park
        @idle = false
        @idle_deadline = nil
        @context.connection_closed(self)
      end

      # @return [Boolean] whether it was parked waiting its turn.
      def end_turn_park
        return false unless @turn

        @turn = false
        @context.turns_parked -= 1
        true
      end

      # A request's head is complete: acquires a request slot, waiting (FIFO,
      # reading nothing more meanwhile) while every one is taken.
      def acquire_slot
        @waited = @admission.acquire
        @slot = true
        @slot_at = Clock.now
      end

      # Gives the request slot back, if it holds one.
      # @return [Boolean] whether it held the slot for {TURN} or longer: its
      #   next request then waits its turn (see #read_next_request).
      def release_slot
        return false unless @slot

        @slot = false
        @admission.release
        Clock.now - @slot_at >= TURN
      end

      # The app called `env["neverblock.mark_as_io_bound"]`: the request gives
      # its slot back for the rest of its life (see the class comment).
      # @return [Boolean] whether it held one (false when called twice, or
      #   after the response, or from a request already without one).
      def mark_as_io_bound
        return false unless @slot && @admission.on_loop? # not from another thread: Admission is the loop's

        release_slot
        @admission.marked_io_bound
        true
      end

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

      # Calls the app for one request and writes its response.
      # @return [Boolean] whether the connection stays open.
      def serve(request)
        @answered = true
        env = request.finish
        @context.request_started
        access_log = @context.access_log
        metrics = @context.metrics
        started = Clock.now if access_log || metrics
        line = access_log.start(env) if access_log
        @status = nil # what the access log shows: set once the response is known
        deadline = (request.head_at + @request_timeout if @request_timeout)
        if (tracer = @context.request_tracer)
          traced(tracer, request, env, deadline)
        else
          respond(request, env, deadline)
        end
      ensure
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
      def respond(request, env, deadline)
        if deadline
          @response.started = false # not the last request's response: nothing of this one's is sent yet
          return timed_out(request, env, nil) if deadline <= Clock.now
        end
        begin
          @app_env = env
          status, headers, body = deadline ? before(deadline) { @context.app.call(env) } : @context.app.call(env)
        rescue StandardError => e
          raise if e.is_a?(Cancelled)
          return timed_out(request, env, e) if deadline && expiry?(e)

          app_failed(e, env)
          return finished(env, nil, nil, e) && false if @hijacked # the socket is the app's, even now

          @status = 500
          keep_alive = request.keep_alive && !@context.stopping?
          @response.write_error(500, keep_alive: keep_alive, head: request.head)
          return finished(env, 500, {}, e) && keep_alive
        ensure
          @app_env = nil
        end
        if deadline && expiry?(framework_error(env))
          close_body(body, env) # an error page for the expiry, not an answer of the app's
          return timed_out(request, env, framework_error(env))
        end
        @status = status
        if @hijacked
          close_body(body, env)
          return finished(env, status, headers, nil) && false
        end

        keep_alive = request.keep_alive && !@context.stopping? # a stop during the app closes after it
        # An app that answered past its deadline (it rescued the expiry, or
        # computed past it without waiting) has its answer written, bounded
        # by write_timeout only.
        deadline = nil if deadline && deadline <= Clock.now
        write_response(request, env, status, headers, body, keep_alive, deadline)
      end

      # Runs the block until `deadline`: past it, its next wait raises a
      # {RequestTimeout} (made only then: a request in time allocates none).
      def before(deadline, &block)
        Fiber.scheduler.timeout_after(deadline - Clock.now, RequestTimeout, @request_timeout, &block)
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
        @context.request_timed_out
        NeverBlock.logger.warn("NeverBlock::Server: #{env['REQUEST_METHOD']} #{env['PATH_INFO']} timed out after " \
                               "#{(Clock.now - request.head_at).round(3)} s (request_timeout #{@request_timeout} s, " \
                               "pid #{Process.pid})#{' before the app was called' unless error}")
        return finished(env, nil, nil, error) && false if @hijacked

        unless @response.started
          @status = 503
          @response.write_error(503, head: request.head, retry_after: RETRY_AFTER)
        end
        finished(env, @status, {}, error)
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
            keep_alive = before(deadline) { @response.write(request, status, headers, body, keep_alive) }
          else
            keep_alive = @response.write(request, status, headers, body, keep_alive)
          end
        rescue Response::ClientGone => e
          error = e
          keep_alive = false
        rescue StandardError => e
          raise if e.is_a?(Cancelled)

          error = e
          keep_alive = false
          # Under request_timeout, the body's each or call(stream) waited past the deadline.
          expired = deadline && expiry?(e)
          unless expired
            app_failed(e, env)
            # Before the first byte a clean 500 is still possible; after it, only
            # closing the connection tells the client the response is incomplete.
            @response.write_error(500, head: request.head) unless @response.started
          end
        ensure
          close_body(body, env)
          finished(env, status, headers, error) unless expired
        end
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
      def finished(env, status, headers, error)
        env["rack.response_finished"]&.reverse_each do |callback|
          callback.call(env, status, headers, error)
        rescue StandardError => e
          app_failed(e, env)
        end
        true
      end

      # Answers a refused request and closes (the end of an upgrade, already
      # served, has no status: the connection just closes).
      def refuse(error)
        return unless error.status

        @context.refusal_log.refused(error, remote_addr)
        @response.write_error(error.status)
        linger
      rescue Response::ClientGone
        nil
      end

      def linger
        @socket.close_write
        deadline = Clock.now + LINGER_SECONDS
        drained = 0
        buffer = @context.read_buffer
        while drained < LINGER_BYTES
          data = @socket.read_nonblock(READ_SIZE, buffer, exception: false)
          if data == :wait_readable
            remaining = deadline - Clock.now
            break unless remaining.positive? && @socket.wait_readable(remaining)
          else
            break unless data

            drained += data.bytesize
          end
        end
      rescue *GONE
        nil
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

      def base_env
        {
          "SCRIPT_NAME" => "",
          "REMOTE_ADDR" => remote_addr,
          "rack.url_scheme" => @listener.tls ? "https" : "http",
          "rack.errors" => $stderr,
          "rack.hijack?" => true,
          "rack.hijack" => method(:hijack),
          MARK_AS_IO_BOUND => method(:mark_as_io_bound),
          "rack.multithread" => false,
          "rack.multiprocess" => false,
          "rack.run_once" => false,
          "SERVER_SOFTWARE" => SOFTWARE
        }.tap { |env| env[EARLY_HINTS] = method(:early_hints) if @context.early_hints }
      end

      def remote_addr
        return "127.0.0.1" if @listener.unix?

        -@socket.remote_address.ip_address # interned: idle connections share it
      rescue SystemCallError
        ""
      end

      def local_host
        host = @socket.local_address.ip_address
        -(host.include?(":") ? "[#{host}]" : host)
      rescue SystemCallError
        "localhost"
      end
    end
  end
end
