# frozen_string_literal: true

module NeverBlock
  class Server
    # One client connection, served in tasks of the server's FiberPool:
    # reads, parses, calls the app for each request in order (pipelined
    # requests included) and keeps the connection open while HTTP and the
    # server allow. The {Acceptor} makes one per accepted (or handed over)
    # socket and calls {#run} in a pooled task, {#resume} when the {IdleSet}
    # finds it readable again; the {IdleSweeper} calls {#expire_idle}, and a
    # stopping server {#close_if_idle}. All it uses of its server comes in a
    # {Context}. Reading requests and the request slot are here; waiting
    # between requests and parking in {Parking}; calling the app and writing
    # the response in {Exchange}.
    #
    # Waiting for its next request with nothing of it read, the connection
    # holds no fiber for long where the server has an {IdleSet} (Linux):
    # after a sweep interval of waiting in its fiber (at once when many
    # wait so), its task parks it there and ends ({#parked?}), and when its
    # socket turns readable the server calls {#resume} in a new task.
    # Otherwise (no IdleSet, a TLS connection with decrypted bytes pending,
    # a stopping server) its fiber waits on the socket.
    #
    # From the moment a request is complete (head and body read) until it
    # is answered it holds one of the server's `fiber_pool` request slots.
    # Waiting for its next request, reading that request's head (bounded by
    # `max_header_bytes` and `header_timeout`) and its body (bounded by
    # `max_body` and {BodyPace}: `body_timeout`, `min_body_rate`,
    # `request_timeout`; kept in memory up to `max_body_in_memory`, past that
    # in a Tempfile) it holds none: clients that trickle partial heads or
    # bodies (slowloris) take no request slot from complete requests, and do
    # not stop the server accepting. A complete request waits for a slot
    # before the app is called. A request whose app calls
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
    # request is answered 503 (see {Exchange}).
    class Connection
      include Exchange
      include StreamedResponse
      include Parking

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
      # 200 ms. After a shorter request (a fast page, a health check) the
      # connection waits for its next one in its fiber, which costs no park
      # and no new task. Either way it reads only once the next request is
      # there, unless its client pipelines (Parking#read_next_request).
      TURN = 0.001


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
        @hangup_watch = context.hangup_watch # the same (set for the server's life)
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
        @just_answered = false # it answered a request since its last look for the next one (Parking#read_next_request)
        @read_ahead = listener.tls ? true : false # that look reads before it waits: TLS may hold the bytes decrypted; set for a client that pipelines
        @brisk = false # its last next request came soon (see #came_back_soon?)
        @slot_at = nil # when it took its request slot (monotonic seconds; see TURN)
        @slot_freed_at = nil # when it last gave its slot back (#release_slot)
        @turn = false # parked waiting its turn, not idle (see #park)
        @wait_cut = false # a wait on the socket was cut short (see #movable?)
        @app_task = nil # the task answering its request, while it does (see #cancel_for_hangup)
        @hung_up = false # its client hung up while the app ran (see #cancel_for_hangup)
        @stop_grace_taken = false # it waited for a request on its way at a stop (see #request_on_its_way?)
      end

      # Serves requests until the client or HTTP ends the connection, an
      # error closes it, the server stops, or it parks ({#parked?}: then
      # {#resume} goes on). Does not close the socket.
      # @return [void]
      def run
        @fiber = Fiber.current
        # Responses go out in as few writes as possible; Nagle would only delay
        # them. (On Linux the socket has it from its listener: Listener#nodelay?)
        @socket.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1) unless @listener.unix? || @listener.nodelay?
        limits = @context.limits
        @limits = limits
        @request_timeout = limits.request_timeout
        if @listener.tls # the handshake, like a request head, holds no request slot
          @socket = @listener.secure(@socket, Clock.now + limits.header_timeout)
          return unless @socket
        end
        @parser = Parser.new(limits, base_env, @listener.unix? ? "localhost" : local_host, @listener.port_text,
                             @context.head_parser)
        @response = Response.new(@socket, limits.write_timeout, @context.head_parser)
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

      # Closes the socket, unless the app took it (rack.hijack) or it is
      # closed already. A fiber that waited its turn for the next request
      # in the connection (Parking#wait_turn) then ends.
      # @return [void]
      def close
        @io.close unless @io.closed? || @hijacked
        wake_turn
      end

      # The Rack full hijack (`env["rack.hijack"].call`): from now on the
      # socket is the app's. The server no longer counts the connection,
      # ignores the app's response, and never reads or writes the socket;
      # it closes it only to end the request's work serving it, as any
      # request's work ends: at `request_timeout` unless the app opted out
      # ({HIJACK_TIMEOUT}), when the client hangs up, at a stop after
      # `shutdown_timeout` (see {Hijacks}). Not when the app raises.
      #
      # Only the request being answered may take the socket, while the app
      # handles it, and only if the client sent nothing after it yet: bytes
      # already read from the socket could not reach the app. An Upgrade or
      # CONNECT request always qualifies (see {Parser}).
      #
      # The app may serve the socket in the request's own fiber (which holds
      # a connection slot until it returns) or in tasks it spawns (which the
      # server cancels at a stop, after `shutdown_timeout`). Also sets
      # `rack.hijack_io`.
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

      # @api private
      # Whether the client closed or reset the connection, by a peek that
      # reads nothing ({HangupWatch}); a socket the app took is looked at
      # too while its call runs (one the app closed is not a hang-up).
      # @return [Boolean]
      def client_gone?
        peeked = peek
        peeked.nil? || peeked == "" # end of file (nil from Ruby 3.3 on)
      rescue Errno::ECONNRESET, Errno::EPIPE, Errno::ENOTCONN, Errno::ETIMEDOUT
        true
      rescue IOError, SystemCallError
        false
      end

      # @api private
      # Its client hung up while the app handled its request: the request's
      # fiber gets {HangupWatch::HungUp} (and its tasks are cancelled with it).
      # @return [void]
      def cancel_for_hangup
        task = @app_task or return

        @hung_up = true
        Fiber.scheduler.interrupt(task, HangupWatch::HungUp.new)
      end

      private

      # The first byte the client sent that is not read yet, left in the
      # socket: a String, "" or nil at end of file, :wait_readable when none
      # came ({#client_gone?}, Parking's idle expiry).
      def peek
        @io.recv_nonblock(1, Socket::MSG_PEEK, exception: false)
      end

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
          while (request = requests.first)&.complete
            requests.shift
            @read_ahead = true unless requests.empty? # the client pipelines: its next request may be there already
            acquire_slot unless @slot # its first request, or the request before it was marked IO-bound
            begin
              keep_open = answer(request)
            ensure
              request.close # a spooled body's file
            end
            return unless keep_open
          end
          return refuse(error) if error
          return if @context.stopping? && !@parser.in_message? && !request_on_its_way?

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

      # The server is stopping, and the last response's head, sent before
      # the stop began (a stream, a long body), promised keep-alive: its
      # client may reuse the connection the moment the response ends (a
      # proxy does) and have sent its next request already. As an idle
      # connection at a stop gets (Acceptor#drain), it gets STOP_IDLE_GRACE
      # (at most `idle_timeout`) for that request, which is then answered
      # with `connection: close`; once per connection. Closed at once, the
      # request would be reset unread, and a proxy tells its client only
      # EOF. Holds no request slot meanwhile, and is not idle to the drain
      # (which may be over): its own wait bounds it. A wait that ran out
      # looks once more just before the connection closes: a proxy that put
      # the host back in its balancer as the grace ended may have sent a
      # request meanwhile (between the timer and this fiber's turn, a loop
      # turn on a loaded machine), which closing would reset unread.
      # @return [Boolean] whether the client sent something (or closed) in time.
      def request_on_its_way?
        return false if @stop_grace_taken

        @stop_grace_taken = true
        @just_answered = false # its wait is over: what came is read at once, with no idle wait the drain would end
        release_slot
        @socket.wait_readable([STOP_IDLE_GRACE, @limits.idle_timeout].min) ? true : !peek.equal?(:wait_readable)
      end

      # @return [String, nil] the next bytes, or nil when the connection
      #   should just be closed (EOF, idle timeout).
      # @raise [HTTPError] 408 when a request is too slow.
      def read_more
        return read_next_request unless @parser.in_message?

        release_slot # the rest of a pipelined head, or a body, arrives holding none
        return read_body if @parser.in_body?

        deadline = @parser.started_at + @limits.header_timeout
        buffer = @context.read_buffer
        last_look = false
        loop do
          data = @socket.read_nonblock(READ_SIZE, buffer, exception: false)
          return data unless data == :wait_readable
          break if last_look

          # A wait that ran out gets one more read: bytes that came as it did
          # (its timer and the socket ready on one turn, after a pause of the
          # process) arrived in time. A wait that ended with no whole read (a
          # TLS record still arriving) waits again only for what is left.
          timeout = deadline - Clock.now
          last_look = !(timeout.positive? && @socket.wait_readable(timeout))
        end
        refuse(HTTPError.new(408, "headers not complete within #{@limits.header_timeout} s"))
        nil
      end

      # #read_more for a request whose head is complete and whose body is
      # still arriving: paced by its {BodyPace} (`body_timeout`,
      # `min_body_rate`, `request_timeout`), else refused with 408.
      def read_body
        pace = (@body_pace ||= BodyPace.new(@limits))
        pace.start(@parser.body_request, Clock.now)
        buffer = @context.read_buffer
        last_look = false
        loop do
          data = @socket.read_nonblock(READ_SIZE, buffer, exception: false)
          unless data == :wait_readable
            pace.read(data.bytesize, Clock.now) if data
            return data
          end
          break if last_look

          wait = pace.wait(Clock.now)
          last_look = !(wait.positive? && @socket.wait_readable(wait)) # one more read, as in #read_more
        end
        refuse(HTTPError.new(408, pace.expired(Clock.now)))
        nil
      end

      # A request is complete: acquires a request slot, waiting (FIFO,
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
        # (The connection's wait for its next request, which follows, takes
        # its idle deadline from this reading: Parking#read_next_request.)
        (@slot_freed_at = Clock.now) - @slot_at >= TURN
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

      # (PeerAddress, not an Addrinfo: on Ruby 3.3+ each getnameinfo starts
      # a thread.)
      def remote_addr
        return "127.0.0.1" if @listener.unix?

        -PeerAddress.remote(@socket) # interned: idle connections share it
      rescue SystemCallError, ArgumentError
        ""
      end

      def local_host
        host = PeerAddress.local(@socket)
        -(host.include?(":") ? "[#{host}]" : host)
      rescue SystemCallError, ArgumentError
        "localhost"
      end
    end
  end
end
