# frozen_string_literal: true

require "io/wait"
require "socket"
require "uri"

module NeverBlock
  class CLI
    class Ctl
      # One HTTP/1.0 request to a master's control listener and its answer,
      # over TCP or a unix socket, all of it (connecting, sending, reading)
      # within one deadline: a master that does not answer costs `neverblock
      # ctl` its `--timeout`, not forever.
      #
      # The answer ends where its `content-length` says (the listener always
      # sends one), not where the connection does: a copy of the connection
      # left open in another process (a worker forked at the wrong moment)
      # does not hold the answer up.
      class Exchange
        # The listener took the request but gave no answer: not within the
        # timeout, none at all (the connection closed first), or not HTTP.
        class Unanswered < BaseError; end

        # Longest read at a time (bytes).
        READ_SIZE = 65_536

        # @param url [String] `tcp://HOST:PORT` or `unix://PATH`.
        # @param timeout [Float, Integer] seconds for the whole exchange.
        def initialize(url, timeout)
          @url = url
          @timeout = timeout
          @deadline = nil
        end

        # @param method [String] `GET` or `POST`.
        # @param path [String]
        # @param token [String, nil] sent as `Authorization: Bearer TOKEN`.
        # @return [Array(Integer, String)] the answer's status and body.
        # @raise [Unanswered] see {Unanswered}.
        # @raise [SystemCallError, SocketError] the listener cannot be reached.
        def request(method, path, token)
          @deadline = Clock.now + @timeout
          socket = connect
          auth = token ? "authorization: Bearer #{token}\r\n" : ""
          socket.write("#{method} #{path} HTTP/1.0\r\nhost: neverblock\r\n#{auth}content-length: 0\r\n\r\n")
          parse(read_answer(socket))
        ensure
          socket&.close
        end

        private

        def connect
          return connect_unix(@url.delete_prefix("unix://")) if @url.start_with?("unix://")

          uri = URI.parse(@url.sub(%r{\Atcp://}, "http://"))
          Socket.tcp(uri.host, uri.port, connect_timeout: @deadline - Clock.now)
        rescue Errno::ETIMEDOUT
          raise Unanswered, late("took no connection")
        end

        # A unix socket's connect(2) waits only while the listener's queue
        # is full (nothing accepts); without blocking, Linux says so at once
        # (EAGAIN), and there is no point waiting for the deadline.
        def connect_unix(path)
          socket = Socket.new(:UNIX, :STREAM)
          address = Socket.sockaddr_un(path)
          begin
            socket.connect_nonblock(address)
          rescue IO::WaitWritable # other systems: the connection is on its way
            wait(socket, :wait_writable, "took no connection")
            begin
              socket.connect_nonblock(address)
            rescue Errno::EISCONN
              nil
            end
          end
          socket
        rescue Errno::EAGAIN
          socket.close
          raise Unanswered, "#{@url} takes no more connections (its queue is full): the master does not accept them"
        rescue StandardError
          socket&.close
          raise
        end

        # Reads until the answer is whole (its head and `content-length`
        # bytes of body), or to the connection's end when it has no length.
        def read_answer(socket)
          answer = +""
          until (size = whole_size(answer)) && answer.bytesize >= size
            chunk = socket.read_nonblock(READ_SIZE, exception: false)
            case chunk
            when :wait_readable then wait(socket, :wait_readable, "did not answer")
            when nil then break
            else answer << chunk
            end
          end
          answer
        end

        # @return [Integer, nil] the answer's size in bytes once its head is
        #   in and gives a `content-length`.
        def whole_size(answer)
          head_end = answer.index("\r\n\r\n") or return nil
          length = answer[0, head_end][/^content-length:[ \t]*(\d+)\r?$/i, 1] or return nil
          head_end + 4 + Integer(length)
        end

        def parse(answer)
          raise Unanswered, "#{@url} closed the connection without answering" if answer.empty?

          head, body = answer.split("\r\n\r\n", 2)
          status = head[%r{\AHTTP/1\.[01] (\d{3})}, 1]
          raise Unanswered, "#{@url} did not answer in HTTP: #{answer[0, 80].inspect}" unless status

          [Integer(status), body.to_s]
        end

        def wait(socket, event, what)
          left = @deadline - Clock.now
          return if left.positive? && socket.public_send(event, left)

          raise Unanswered, late(what)
        end

        def late(what)
          "#{@url} #{what} within #{format('%g', @timeout)} s (--timeout SECONDS waits longer); " \
            "is the master stuck? Its log, or QUIT to the master, says what it is doing"
        end
      end
    end
  end
end
