# frozen_string_literal: true

require "etc"
require "neverblock"
require_relative "server/errors"
require_relative "server/limits"
require_relative "server/listener"
require_relative "server/request"
require_relative "server/parser"
require_relative "server/response"
require_relative "server/connection"
require_relative "server/cluster"
require_relative "server/status_endpoint"

module NeverBlock
  # A fiber-per-connection Rack 3 server on the NeverBlock loop: one process
  # serves many slow requests at once, because a request waiting on a socket,
  # a database or a sleep suspends only its fiber.
  #
  #   server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:9292"], fiber_pool: 1000)
  #   trap("TERM") { server.stop }
  #   server.run   # blocks until #stop
  #
  # - Each connection is served by a fiber of a bounded {FiberPool}; its
  #   requests (pipelined ones in order) run in that fiber. When all
  #   `fiber_pool` fibers are busy, the server stops accepting, so new
  #   connections wait in the kernel's backlog: none is dropped.
  # - HTTP/1.1 keep-alive (and HTTP/1.0's `Connection: keep-alive`), chunked
  #   request bodies, `Expect: 100-continue`, streaming bodies (`each` and
  #   `call(stream)`, chunked when there is no Content-Length), HEAD.
  # - Parsing is llhttp's C parser (the `llhttp` gem); {Limits} bound what a
  #   client may send, and refused requests get 400/408/413/414/431/505 and
  #   a closed connection.
  # - Not yet: `rack.hijack` (`rack.hijack?` is false; an Upgrade or CONNECT
  #   request is answered by the app, then the connection is closed), TLS,
  #   workers.
  class Server
    # SERVER_SOFTWARE in the env.
    SOFTWARE = "NeverBlock/#{VERSION}"

    # @return [#call] the Rack app.
    attr_reader :app

    # @return [Limits]
    attr_reader :limits

    # @api private
    # @return [String] the loop's read buffer: every connection reads into it
    #   and parses at once, so idle connections hold no buffer.
    attr_reader :read_buffer

    # @param app [#call] a Rack 3 app.
    # @param bind [Array<String>, String] `tcp://HOST:PORT` (port 0 picks one) or `unix://PATH`.
    # @param workers [Integer] processes to fork and serve in; 0 serves in this
    #   process (no master). With workers, {#run} is the master: it binds,
    #   forks, respawns workers that die and handles signals (see {Cluster}).
    # @param fiber_pool [Integer] the most connections served at once.
    # @param before_fork [#call, nil] called in the master before the first
    #   worker is forked (close what children must not share).
    # @param on_worker_boot [#call, nil] called with the worker index in each
    #   worker before it accepts (open per-process resources; load the app
    #   when it was not preloaded). An exception fails the worker's boot.
    # @param status_path [String, nil] a path (like `"/_neverblock/status"`)
    #   answered by the server itself with {#stats} as JSON, for GET only;
    #   nil (the default) answers nothing there.
    # @param limits [Hash] see {Limits}: `max_request_target:`, `max_header_bytes:`,
    #   `max_headers:`, `max_body:`, `header_timeout:`, `body_timeout:`,
    #   `idle_timeout:`, `write_timeout:`, `shutdown_timeout:`.
    # @raise [ArgumentError] for an invalid bind spec or option.
    def initialize(app, bind: ["tcp://0.0.0.0:9292"], workers: Etc.nprocessors, fiber_pool: 1000,
                   before_fork: nil, on_worker_boot: nil, status_path: nil, **limits)
      raise ArgumentError, "app must respond to call" unless app.respond_to?(:call)

      @app = app
      @workers = NeverBlock.validate_size!(workers, :workers, minimum: 0)
      @hooks = { before_fork: before_fork, on_worker_boot: on_worker_boot }.freeze
      if status_path
        raise ArgumentError, "status_path must start with /, got #{status_path.inspect}" unless status_path.to_s.start_with?("/")

        @app = StatusEndpoint.new(app, self, status_path.to_s)
      end
      @cluster = nil
      @worker_index = nil
      @on_ready = nil

      @limits = Limits.build(limits)
      @pool_size = NeverBlock.validate_size!(fiber_pool, :fiber_pool)
      @listeners = Array(bind).map { |spec| Listener.new(spec) }
      raise ArgumentError, "bind needs at least one address" if @listeners.empty?

      @read_buffer = String.new(capacity: Connection::READ_SIZE, encoding: Encoding::BINARY)
      @connections = {}.compare_by_identity
      @in_flight = 0
      @total = 0
      @pool = nil
      @scheduler = nil
      @waiters = [] # fibers waiting for room (acceptors) or for the last connection to close (#shutdown)
      @stopping = false
      @stop_requested = false
      @wake_reader, @wake_writer = IO.pipe
    end

    # Opens the listening sockets (at once; {#run} does it too) and returns
    # where they listen, with the real port for a port-0 bind.
    # @return [Array<String>] like `["tcp://127.0.0.1:34567"]`.
    def bound_addresses
      @listeners.each(&:listen).map(&:address)
    end

    # Serves until {#stop}. With `workers: 0` it runs its own NeverBlock
    # loop on this thread (or, called inside a running loop, in it) and
    # returns once the listeners are closed and in-flight requests have
    # finished or been cancelled after `shutdown_timeout`. With workers it is
    # the master of a {Cluster} and returns when every worker has exited.
    # @return [void]
    # @raise [Error] when the server already ran (a Server runs once), or
    #   when workers are asked for inside a running NeverBlock loop.
    def run
      raise Error, "this NeverBlock::Server has already run; create a new one" if @wake_reader.closed?
      return serve_here if @workers.zero?

      Cluster.new(self, @workers, @listeners).run
    end

    # @return [Integer] worker processes (0: serves in the calling process).
    attr_reader :workers

    # @api private
    # Serves in this process until {#stop} (a worker's whole life).
    # @return [void]
    def serve_here
      raise Error, "this NeverBlock::Server has already run; create a new one" if @wake_reader.closed?

      @listeners.each(&:listen)
      NeverBlock.run do
        @scheduler = NeverBlock.current_scheduler!
        @pool = FiberPool.new(size: @pool_size, queue_limit: @limits.max_connections)
        @accepting = {}
        acceptors = @listeners.map { |listener| NeverBlock.spawn { accept_loop(listener) } }
        @on_ready&.call
        @wake_reader.wait_readable until @stop_requested
        shutdown(acceptors)
      end
    ensure
      @listeners.each(&:close)
      @wake_reader.close
      @wake_writer.close
    end

    # Stops the server: no new connections; idle keep-alive connections are
    # closed; requests in flight finish (their connections then close) for
    # up to `shutdown_timeout` seconds and are cancelled after that.
    # {#run} then returns. Safe from any thread and from a signal handler.
    # @return [void]
    def stop
      return @cluster.stop if @cluster

      @stop_requested = true
      @wake_writer.write_nonblock(".", exception: false)
    rescue IOError
      nil
    end

    # @return [Boolean] true once {#stop} has been acted on.
    def stopping?
      @stopping
    end

    # In a worker (or with `workers: 0`): this process's connections,
    # requests, fiber pool and the database pools that have connections
    # ({ConnectionPool.active}). In the master of a {Cluster}: its workers.
    # @return [Hash] `{pid:, worker:, connections:, requests_in_flight:,
    #   requests_total:, fiber_pool:, database_pools:}`; fiber_pool is
    #   {FiberPool#stats} (nil when not running); or {Cluster#stats} in the master.
    def stats
      return @cluster.stats if @cluster

      { pid: Process.pid, worker: @worker_index, connections: @connections.size,
        requests_in_flight: @in_flight, requests_total: @total, fiber_pool: @pool&.stats,
        database_pools: ConnectionPool.active.map { |pool| { name: pool.name, **pool.stats } } }
    end

    # @api private
    # @return [Hash{Symbol => #call, nil}] `before_fork`, `on_worker_boot`.
    attr_reader :hooks

    # @api private
    attr_writer :cluster, :worker_index, :on_ready

    # @api private
    def request_started
      @in_flight += 1
      @total += 1
    end

    # @api private
    def request_finished
      @in_flight -= 1
    end

    private

    # Takes a slot before each accept, so at most `fiber_pool` connections
    # are served and the rest wait in the kernel backlog. Only its two waits
    # (for a slot, for a connection) may be interrupted by {#shutdown}: a
    # cancel inside FiberPool#spawn would lose track of a running connection.
    def accept_loop(listener)
      until @stopping
        slot = false
        @accepting[listener] = true
        begin
          @slots.push(true)
          slot = true
          socket = listener.accept
        rescue Exception # rubocop:disable Lint/RescueException -- give the slot back, whatever ended the wait
          @slots.pop if slot # our own token is still queued: this does not wait
          raise
        ensure
          @accepting.delete(listener)
        end
        serve(socket, listener)
      end
    end

    def serve(socket, listener)
      connection = Connection.new(self, socket, listener)
      @connections[connection] = true
      spawned = false
      connection.task = @pool.spawn do
        spawned = true
        connection.run
      ensure
        @connections.delete(connection)
        socket.close unless socket.closed?
        @slots.pop
      end
    rescue StandardError
      raise if spawned

      @connections.delete(connection)
      socket.close unless socket.closed?
      @slots.pop
      raise
    end

    def shutdown(acceptors)
      @stopping = true
      @listeners.zip(acceptors) { |listener, acceptor| acceptor.cancel if @accepting[listener] }
      acceptors.each(&:wait)
      @listeners.each(&:close)
      @connections.each_key(&:close_if_idle)
      @pool.shutdown(@limits.shutdown_timeout)
    end
  end
end
