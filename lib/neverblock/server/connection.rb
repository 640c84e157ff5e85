# frozen_string_literal: true

module NeverBlock
  class Server
    # One client connection, served in one fiber of the server's FiberPool:
    # reads, parses, calls the app for each request in order (pipelined
    # requests included) and keeps the connection open while HTTP and the
    # server allow.
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

      # @return [Task, nil] the task serving it (set by the server).
      attr_accessor :task

      # @param server [Server]
      # @param socket [Socket] an accepted client socket.
      # @param listener [Listener] that accepted it.
      def initialize(server, socket, listener)
        @server = server
        @socket = socket
        @listener = listener
        @idle = false
      end

      # Serves requests until the client or HTTP ends the connection, an
      # error closes it, or the server stops. Does not close the socket.
      # @return [void]
      def run
        # Responses go out in as few writes as possible; Nagle would only delay them.
        @socket.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1) unless @listener.unix?
        limits = @server.limits
        @limits = limits
        @parser = Parser.new(limits, base_env, @listener.unix? ? "localhost" : local_host, (@listener.port || 0).to_s)
        @response = Response.new(@socket, limits.write_timeout)
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
            return unless serve(request)
          end
          return refuse(error) if error
          return if @server.stopping? && !@parser.in_message?

          if (request = requests.first)&.expects_continue
            request.expects_continue = false
            @response.write_continue
          end
        end
      rescue Response::ClientGone, SystemCallError, IOError
        nil # the client went away (or reset the connection before we started)
      end

      # Ends the connection now if it is waiting for a next request (for
      # {Server#stop}); one in the middle of a request is left to finish.
      # @return [void]
      def close_if_idle
        @task&.cancel if @idle
      end

      private

      # @return [String, nil] the next bytes, or nil when the connection
      #   should just be closed (EOF, idle timeout).
      # @raise [HTTPError] 408 when a request is too slow.
      def read_more
        if !@parser.in_message?
          timeout = @limits.idle_timeout
          @idle = true
        elsif @parser.in_body?
          timeout = @limits.body_timeout
          slow = "no request body for #{timeout} s"
        else
          timeout = @parser.started_at + @limits.header_timeout - Process.clock_gettime(Process::CLOCK_MONOTONIC)
          slow = "headers not complete within #{@limits.header_timeout} s"
        end
        buffer = @server.read_buffer
        loop do
          data = @socket.read_nonblock(READ_SIZE, buffer, exception: false)
          return data unless data == :wait_readable
          next if timeout.positive? && @socket.wait_readable(timeout)
          return nil unless slow

          refuse(HTTPError.new(408, slow))
          return nil
        end
      ensure
        @idle = false
      end

      # Calls the app for one request and writes its response.
      # @return [Boolean] whether the connection stays open.
      def serve(request)
        env = request.finish
        @server.request_started
        begin
          status, headers, body = @server.app.call(env)
        rescue StandardError => e
          raise if e.is_a?(Cancelled)

          app_failed(e, env)
          keep_alive = request.keep_alive && !@server.stopping?
          @response.write_error(500, keep_alive: keep_alive)
          return finished(env, 500, {}, e) && keep_alive
        end
        keep_alive = request.keep_alive && !@server.stopping? # a stop during the app closes after it
        write_response(request, env, status, headers, body, keep_alive)
      ensure
        @server.request_finished
      end

      def write_response(request, env, status, headers, body, keep_alive)
        error = nil
        begin
          keep_alive = @response.write(request, status, headers, body, keep_alive)
        rescue Response::ClientGone => e
          error = e
          keep_alive = false
        rescue StandardError => e
          raise if e.is_a?(Cancelled)

          error = e
          keep_alive = false
          app_failed(e, env)
          # Before the first byte a clean 500 is still possible; after it, only
          # closing the connection tells the client the response is incomplete.
          @response.write_error(500) unless @response.started
        ensure
          close_body(body, env)
          finished(env, status, headers, error)
        end
        keep_alive
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

      # Answers a refused request and closes (an upgrade has no status: it
      # is only closed, since rack.hijack is not supported yet).
      def refuse(error)
        return unless error.status

        @response.write_error(error.status)
        linger
      rescue Response::ClientGone
        nil
      end

      def linger
        @socket.close_write
        deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + LINGER_SECONDS
        drained = 0
        buffer = @server.read_buffer
        while drained < LINGER_BYTES
          data = @socket.read_nonblock(READ_SIZE, buffer, exception: false)
          if data == :wait_readable
            remaining = deadline - Process.clock_gettime(Process::CLOCK_MONOTONIC)
            break unless remaining.positive? && @socket.wait_readable(remaining)
          else
            break unless data

            drained += data.bytesize
          end
        end
      rescue *GONE
        nil
      end

      def app_failed(error, env)
        NeverBlock.logger.error("NeverBlock::Server: #{env['REQUEST_METHOD']} #{env['PATH_INFO']} failed: " \
                                "#{error.class}: #{error.message}\n#{(error.backtrace || []).join("\n")}")
      end

      def base_env
        {
          "SCRIPT_NAME" => "",
          "REMOTE_ADDR" => remote_addr,
          "rack.url_scheme" => "http",
          "rack.errors" => $stderr,
          "rack.hijack?" => false,
          "rack.multithread" => false,
          "rack.multiprocess" => false,
          "rack.run_once" => false,
          "SERVER_SOFTWARE" => SOFTWARE
        }
      end

      def remote_addr
        return "127.0.0.1" if @listener.unix?

        @socket.remote_address.ip_address
      rescue SystemCallError
        ""
      end

      def local_host
        host = @socket.local_address.ip_address
        host.include?(":") ? "[#{host}]" : host
      rescue SystemCallError
        "localhost"
      end
    end
  end
end
