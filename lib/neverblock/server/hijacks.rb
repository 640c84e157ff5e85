# frozen_string_literal: true

module NeverBlock
  class Server
    # The register of fully hijacked sockets (`env["rack.hijack"].call`, or
    # a partial hijack's callback) that tasks of their request still serve
    # after the request's call returned: a WebSocket's reader, a pinger. The
    # socket is the app's (the server never reads, writes or counts it), but
    # the work serving it is a part of the request's task tree, and ends the
    # way the rest of the tree does:
    #
    # - at the request's deadline (`request_timeout`, counted from the end
    #   of its head), unless the app set `env["neverblock.hijack_timeout"] =
    #   false` ({HIJACK_TIMEOUT}): the tasks are cancelled and the socket closed;
    # - when the socket closes: the app closed it (one task saw the client's
    #   close frame, say) or the client hung up (a peek every INTERVAL seconds
    #   that reads nothing, as the {HangupWatch} does): the tasks still
    #   running are cancelled, and the socket closed;
    # - when the server stops: the tasks get `shutdown_timeout` seconds to
    #   end, then are cancelled, and their sockets closed.
    #
    # A socket the app handed out of the tree (to a thread of its own, as
    # Action Cable does, to a detached task, or to a queue) has no task of
    # the request's running once the call returns: it is not registered,
    # and only its owner ends it.
    #
    # Who calls it: Exchange#answer at a hijacked request's end (#adopt), the
    # server's shutdown (#stop); its own task looks every INTERVAL seconds
    # while it holds any. Loop's thread only.
    class Hijacks
      # Seconds between looks.
      INTERVAL = HangupWatch::INTERVAL

      # One hijacked socket: `io` is what the app got (an SSLSocket over TLS),
      # `socket` the accepted socket beneath it (peeked), `tasks` what serves
      # it, `deadline` when it is cut (monotonic seconds; nil: never).
      Hijack = Struct.new(:io, :socket, :tasks, :deadline)

      def initialize
        @hijacks = {}.compare_by_identity # Hijack => true
        @task = nil # the looking task, while there are hijacks
      end

      # @return [Integer] hijacked sockets whose request's tasks still run.
      def size
        @hijacks.size
      end

      # A request whose app took its socket is over (its call returned or
      # was unwound). A request past its deadline, or whose client hung up
      # while its call ran, has its socket closed now and its tasks
      # cancelled; otherwise, if tasks it spawned still run, they are
      # registered.
      # @param io [IO] the socket the app got.
      # @param socket [Socket] the accepted socket beneath it.
      # @param task [Task] the request's task; `mark` ({Task::Tree#spawned})
      #   names the tasks it spawned for this request.
      # @param env [Hash] the request's env, where the app may have opted
      #   out of the deadline ({HIJACK_TIMEOUT}).
      # @param deadline [Float, nil] monotonic seconds (`request_timeout`);
      #   nil: none.
      # @param gone [Boolean] the client hung up while the call ran.
      # @return [void]
      def adopt(io, socket, task, mark, env, deadline, gone)
        deadline = nil if env[HIJACK_TIMEOUT] == false
        tasks = task.children.select { |child| child.seq > mark }
        hijack = Hijack.new(io, socket, tasks, deadline)
        return finish(hijack) if gone || (deadline && deadline <= Clock.now)
        return if tasks.empty?

        @hijacks[hijack] = true
        @task ||= NeverBlock.spawn(detached: true, internal: true) { run }
      end

      # At a stop, after the drain: no more looks. The tasks serving the
      # sockets are among what the app left running, which the server
      # cancels next, logging each ({AppTasks}); their `ensure` may still
      # write (a WebSocket's close frame). Then {#close}.
      # @return [void]
      def stop
        @task&.cancel
      end

      # At a stop, once what the app left running has ended (or
      # `shutdown_timeout` has passed): closes the sockets of the hijacks
      # still registered, cancelling any task of theirs still running.
      # @return [void]
      def close
        hijacks = @hijacks.keys
        @hijacks.clear
        hijacks.each { |hijack| finish(hijack) }
      end

      # One look: ends the hijacks past their deadline or whose socket
      # closed, and forgets those whose tasks all ended; HangupWatch::SLICE
      # of them a turn of the loop (from its task only).
      # @return [void]
      def look
        now = Clock.now
        @hijacks.keys.each_slice(HangupWatch::SLICE).with_index do |slice, index|
          Fiber.scheduler.yield if index.positive?
          slice.each do |hijack|
            next unless @hijacks.key?(hijack) # (ended by #stop meanwhile)

            hijack.tasks.select!(&:alive?)
            if hijack.tasks.empty?
              @hijacks.delete(hijack)
            elsif (hijack.deadline && hijack.deadline <= now) || closed?(hijack.socket)
              @hijacks.delete(hijack)
              finish(hijack)
            end
          end
        end
      end

      private

      def run
        until @hijacks.empty?
          NeverBlock.sleep(INTERVAL)
          look
        end
      ensure
        @task = nil
      end

      # Whether the socket closed: on our side (by the app), or the client
      # closed or reset it (a peek that reads nothing: see {HangupWatch}).
      def closed?(socket)
        return true if socket.closed?

        peeked = socket.recv_nonblock(1, Socket::MSG_PEEK, exception: false)
        peeked.nil? || peeked == ""
      rescue Errno::ECONNRESET, Errno::EPIPE, Errno::ENOTCONN, Errno::ETIMEDOUT
        true
      rescue IOError, SystemCallError
        false
      end

      # Cancels the tasks still serving the socket, then closes it.
      def finish(hijack)
        hijack.tasks.each(&:cancel)
        [hijack.io, hijack.socket].each do |io|
          io.close unless io.closed?
        rescue StandardError # IOError, SystemCallError, or an SSL error sending close_notify
          nil
        end
      end
    end
  end
end
