# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/raw_response"
require "neverblock/server"
require "rack/lint"
require "net/http"

# Starts a NeverBlock::Server on 127.0.0.1 (port 0) in its own thread and
# talks to it with raw sockets. Test apps are wrapped in Rack::Lint.
module ServerHelper
  HELLO = ->(_env) { [200, { "content-type" => "text/plain", "content-length" => "6" }, ["hello\n"]] }

  def start_server(app = HELLO, lint: true, **options)
    app = Rack::Lint.new(app) if lint
    @server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0, **options)
    @port = Integer(@server.bound_addresses.first[/\d+\z/])
    @server_thread = Thread.new { @server.run }
    @server
  end

  def teardown
    if @server
      @server.stop
      assert @server_thread.join(20), "server did not stop"
    end
    @sockets&.each { |socket| socket.close unless socket.closed? }
    super
  end

  def connect
    socket = TCPSocket.new("127.0.0.1", @port)
    (@sockets ||= []) << socket
    socket
  end

  # A new connection to `port` that has sent `request`, without waiting to
  # be accepted (it may sit in the kernel's backlog). Connecting and writing
  # without blocking keeps the GVL, so other threads of the test do not
  # spread a batch of these over many of the server's turns.
  def send_without_waiting(port, request)
    socket = Socket.new(:INET, :STREAM)
    (@sockets ||= []) << socket
    address = Socket.sockaddr_in(port, "127.0.0.1")
    begin
      socket.connect_nonblock(address)
    rescue IO::WaitWritable
      socket.wait_writable(10) or flunk("connect timed out")
      socket.connect_nonblock(address, exception: false)
    end
    socket.write_nonblock(request)
    socket
  end

  # Sends raw bytes on a new connection and reads until the server closes it.
  def exchange(raw, timeout: 10)
    socket = connect
    socket.write(raw)
    read_all(socket, timeout: timeout)
  ensure
    socket&.close
  end

  # Reads one response: [status, headers (lowercase keys), body (de-chunked)].
  def read_response(socket, head: false, timeout: 10)
    Timeout.timeout(timeout) { RawResponse.read(socket, head: head) }
  end

  def get(path = "/", extra = "")
    "GET #{path} HTTP/1.1\r\nHost: localhost\r\n#{extra}\r\n"
  end

  # Sends a GET of `path` on `socket` and reads its response (#read_response).
  def request(socket, path = "/")
    socket.write(get(path))
    read_response(socket)
  end

  # Once this is true the server (this process's) made its loop, its pool and its IdleSet.
  def wait_serving
    eventually { @server.stats[:connection_fibers] && @server.instance_variable_get(:@scheduler) }
  end

  # Tasks of the server's loop now (its own few, plus one per connection
  # that holds a fiber).
  def server_tasks
    @server.instance_variable_get(:@scheduler).tasks.size
  end

  # @return [NeverBlock::Server::Connection] the server's connection of
  #   the socket `client` opened (the server runs in this process)
  def server_connection(client)
    port = client.local_address.ip_port
    ObjectSpace.each_object(NeverBlock::Server::Connection).find do |candidate|
      io = candidate.instance_variable_get(:@io)
      !io.closed? && io.remote_address.ip_port == port
    rescue SystemCallError # another test's connection, its client gone (ENOTCONN from getpeername)
      false
    end or flunk("no server connection for the client's port #{port}")
  end

  def fd_count
    Dir.children("/proc/self/fd").size
  end
end

# Test modules that turn one of the server's switches "off" for every test
# of the class that includes them (after ServerHelper), and put it back.
# The switch is off before the class's own setup runs: a server built there
# reads it once (Context reads the head-parser switch when it is made).
module ServerSwitch
  # @param variable [String] the environment variable the server reads.
  # @return [Module]
  def self.off(variable)
    Module.new do
      define_method(:setup) do
        (@switches_before ||= {})[variable] = ENV.fetch(variable, nil)
        ENV[variable] = "off"
        super()
      end

      define_method(:teardown) do
        super()
      ensure
        ENV[variable] = @switches_before[variable]
      end
    end
  end
end

# Its servers hold each idle keep-alive connection in a fiber of its own, as
# without the C extension (NeverBlock::Server::IdleSet turned off), so that
# path stays tested.
FiberPerIdleConnection = ServerSwitch.off(NeverBlock::Server::IdleSet::SWITCH)

# Its servers parse every request head with llhttp's callbacks, as without
# the C extension (NeverBlock::Server::Parser's fast path,
# NeverBlock::HTTPHead, turned off), so that path stays tested in every run.
LlhttpHeads = Module.new do
  include ServerSwitch.off(NeverBlock::Server::Parser::HEAD_PARSER_SWITCH)

  # A server the class's setup started parses with llhttp indeed.
  define_method(:setup) do
    super()
    context = @server&.instance_variable_get(:@context)
    refute context.head_parser, "this class's server takes the C head parser" if context
  end
end
