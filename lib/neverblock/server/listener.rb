# frozen_string_literal: true

require "socket"
require "io/wait"
require_relative "systemd"

module NeverBlock
  class Server
    # One listening socket, from a bind spec: `tcp://HOST:PORT` (`tcp://[::1]:9292`
    # for IPv6; port 0 picks a free port), `unix://PATH`, or
    # `ssl://HOST:PORT?cert=PATH&key=PATH` (TLS; see {TLS}).
    class Listener
      # Connections the kernel queues for us while the server is busy or
      # not accepting (its request slots all taken, see {Acceptor}). Past
      # it the kernel drops a new connection's SYN, and the client sends it
      # again only after 1 s, then 3 s and 7 s: at 1024, 2,000 event streams
      # opened at once on one process had 345 SYNs dropped and their first
      # events a second or more late (`bench/run streams`). Linux caps it at
      # net.core.somaxconn (4096 since Linux 5.4), other systems at theirs.
      BACKLOG = 4096

      # @return [String] the spec it was made from.
      attr_reader :spec

      # @return [OpenSSL::SSL::SSLContext, nil] for an ssl:// bind.
      attr_reader :tls

      # A listener for a socket systemd passed that no bind address named
      # ({Systemd.unclaimed}): it serves plain HTTP there.
      # @param server [TCPServer, UNIXServer]
      # @return [Listener]
      def self.adopt(server)
        address = server.local_address
        listener = new(address.unix? ? "unix://#{address.unix_path}" : "tcp://#{address.inspect_sockaddr}")
        listener.instance_variable_set(:@server, server)
        listener.instance_variable_set(:@inherited, true)
        listener.send(:set_nodelay)
        listener
      end

      # @return [TCPServer, UNIXServer, nil] the listening socket, once open.
      def io
        @server
      end

      # @return [Boolean] whether systemd opened its socket (socket activation).
      def inherited?
        @inherited
      end

      # @param spec [String]
      # @raise [ArgumentError] for a spec that is not tcp://, unix:// or
      #   ssl://, or an ssl:// one whose certificate or key is missing or bad.
      def initialize(spec)
        @spec = spec
        @tls = nil
        case spec
        when %r{\A(tcp|ssl)://\[([^\]]+)\]:(\d+)(?:\?(.*))?\z}, %r{\A(tcp|ssl)://([^:/\[\]?]+):(\d+)(?:\?(.*))?\z}
          scheme, @host, port, query = Regexp.last_match.captures
          @port = Integer(port, 10)
          if scheme == "ssl"
            require_relative "tls"
            @tls = TLS.context(spec, query)
          elsif query
            raise ArgumentError, "bind #{spec.inspect}: tcp:// takes no parameters (TLS is ssl://HOST:PORT?cert=...&key=...)"
          end
        when %r{\Aunix://(.+)\z}
          @path = Regexp.last_match(1)
        else
          raise ArgumentError, "bind must look like tcp://HOST:PORT, unix://PATH or " \
                               "ssl://HOST:PORT?cert=PATH&key=PATH, got #{spec.inspect}"
        end
        @server = nil
        @inherited = false
        @nodelay = false
      end

      # Linux copies a listening TCP socket's TCP_NODELAY into each
      # connection it accepts (the BSDs do not promise it): set once on the
      # listener, it saves a setsockopt(2) per connection.
      NODELAY_INHERITED = RUBY_PLATFORM.include?("linux")

      # @return [Boolean] whether its connections come with TCP_NODELAY set
      #   (else Connection#run sets it on each).
      def nodelay?
        @nodelay
      end

      # Opens the listening socket (once), or takes the one systemd passed
      # for this address (socket activation, {Systemd.claim}).
      # @return [self]
      # @raise [SystemCallError] (`Errno::EADDRINUSE`, `EACCES`, ...) whose
      #   message names the bind spec.
      def listen
        return self if @server

        if (@server = Systemd.claim(host: @host, port: @port, path: @path))
          @inherited = true
          set_nodelay
          return self
        end
        begin
          @server = @path ? listen_unix : TCPServer.new(@host, @port)
        rescue SystemCallError => e
          raise e.class, "cannot listen on #{@spec}"
        end
        @server.listen(BACKLOG)
        @owner = Process.pid
        set_nodelay
        self
      end

      # @return [String] where it listens, with the real port: `tcp://127.0.0.1:34567`
      #   (also once closed: a connection taken in at a stop, and the master's
      #   title, still name it).
      def address
        return "unix://#{@path}" if @path

        @address ||= begin
          addr = @server.local_address
          host = addr.ipv6? ? "[#{addr.ip_address}]" : addr.ip_address
          "#{@tls ? 'ssl' : 'tcp'}://#{host}:#{addr.ip_port}"
        end
      end

      # The connection as its requests are read and answered: the accepted
      # socket, or for ssl:// the TLS session after its handshake (in the
      # calling fiber, until `deadline` on the monotonic clock).
      # @return [Socket, TLS::Socket, nil] nil when the handshake failed.
      def secure(socket, deadline)
        @tls ? TLS.accept(socket, @tls, deadline) : socket
      end

      # @return [Boolean]
      def unix?
        !@path.nil?
      end

      # @return [Integer, nil] the TCP port (also once closed).
      def port
        @bound_port ||= @server.local_address.ip_port unless @path
      end

      # @return [String] {#port} as text, "0" for a Unix socket: the default
      #   SERVER_PORT of its connections (made once, not per connection).
      def port_text
        @port_text ||= -(port || 0).to_s
      end

      # Waits for and returns the next connection; inside NeverBlock only the
      # calling fiber waits.
      # @return [Socket]
      def accept
        loop do
          socket = @server.accept_nonblock(exception: false)
          return socket unless socket == :wait_readable

          @server.wait_readable
        end
      end

      # Accepts a connection the kernel has already queued, without waiting.
      # @return [Socket, nil] nil when none is queued.
      def accept_now
        socket = open_server.accept_nonblock(exception: false)
        socket unless socket == :wait_readable
      rescue Errno::ECONNABORTED, Errno::EPROTO
        nil # the client gave up while it waited in the backlog
      end

      # Waits until a connection is queued (only the calling fiber, inside
      # NeverBlock); {#accept_now} may still find none when another fiber
      # took it first.
      # @return [void]
      def wait_readable
        open_server.wait_readable
      end

      # Connections waiting in the kernel's accept queue, from Linux's
      # TCP_INFO of the listening socket (`tcpi_unacked`, the queue's length
      # on a socket in LISTEN): one getsockopt(2), nothing accepted.
      # @return [Integer, nil] nil for a unix socket, or where it cannot be read.
      def pending_connections
        return nil if @path

        @server.getsockopt(Socket::IPPROTO_TCP, Socket::TCP_INFO).data.unpack1("@24L")
      rescue SystemCallError, NameError, ArgumentError
        nil
      end

      # Closes the socket (and, in the process that bound it, removes a unix
      # socket's file: a forked worker closing its inherited copy leaves the
      # file to the master, which still listens on it).
      # @return [void]
      def close
        return unless @server

        address # remembered for what still names it
        port
        @server.close unless @server.closed?
        File.unlink(@path) if @path && @owner == Process.pid && !@inherited && File.socket?(@path)
      rescue SystemCallError
        nil
      ensure
        @server = nil
      end

      private

      # @raise [IOError] once closed (as the closed socket would).
      def open_server
        @server or raise IOError, "#{@spec}: the listener is closed"
      end

      # TCP_NODELAY on a TCP listener, for its connections to inherit
      # ({NODELAY_INHERITED}); where it cannot be set they get it one by one.
      def set_nodelay
        @nodelay = false
        return if @path || !NODELAY_INHERITED || !@server.local_address.ip?

        @server.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1)
        @nodelay = true
      rescue SystemCallError
        nil
      end

      # A socket file left behind by a dead process is removed; one that a
      # live server answers on is not (bind then fails with EADDRINUSE).
      def listen_unix
        if File.socket?(@path)
          begin
            UNIXSocket.new(@path).close
          rescue Errno::ECONNREFUSED
            File.unlink(@path)
          end
        end
        UNIXServer.new(@path)
      end
    end
  end
end
