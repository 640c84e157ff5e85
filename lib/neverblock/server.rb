# frozen_string_literal: true

require "etc"
require "neverblock"
require_relative "server/errors"
require_relative "server/limits"
require_relative "server/concurrency_limit"
require_relative "server/admission"
require_relative "server/sleeps_until_work"
require_relative "server/idle_sweeper"
require_relative "server/brief_waits"
require_relative "server/idle_set"
require_relative "server/handoff"
require_relative "server/listener"
require_relative "server/request"
require_relative "server/parser"
require_relative "server/response"
require_relative "server/access_log"
require_relative "server/refusal_log"
require_relative "server/metrics"
require_relative "server/context"
require_relative "server/connection"
require_relative "server/cluster"
require_relative "server/cluster/settings"
require_relative "server/cluster/memory"
require_relative "server/cluster/sidecars"
require_relative "server/cluster/hot_restart"
require_relative "server/cluster/worker"
require_relative "server/task_dump"
require_relative "server/status_endpoint"
require_relative "server/lazy_app"
require_relative "rails_integration"

module NeverBlock
  # A fiber-per-connection Rack 3 server on the NeverBlock loop: one process
  # serves many slow requests at once, because a request waiting on a socket,
  # a database or a sleep suspends only its fiber.
  #
  #   server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:9292"], fiber_pool: 1000)
  #   trap("TERM") { server.stop }
  #   server.run   # blocks until #stop
  #
  # - Each connection is served by a fiber of a bounded {FiberPool} (of
  #   `max_connections` fibers); its requests (pipelined ones in order) run
  #   in that fiber. At most `fiber_pool` requests are answered at once,
  #   each from the end of its head until its response is written; an idle
  #   keep-alive connection, or one still sending a request head, holds no
  #   such slot (so clients trickling partial heads, slowloris, do not
  #   starve complete requests). On Linux an idle keep-alive connection
  #   holds no fiber either, once parked in the worker's {IdleSet} (about
  #   3 KB each: 10,000 idle connections take 30 MB); without the C
  #   extension it keeps its fiber waiting (about 20 KB each). A request
  #   whose head arrives while every slot is taken waits for one (FIFO; its
  #   connection reads nothing more meanwhile), and the server stops accepting;
  #   at `max_connections` open connections too. New connections then wait
  #   in the kernel's backlog: none is dropped.
  # - Of those `fiber_pool` slots ({Admission}), an adaptive limit ({ConcurrencyLimit},
  #   on by default) admits only as many requests at once as keep the
  #   loop busy: all of them while requests wait on IO, fewer once the
  #   loop is saturated with computing requests, whose CPU per request,
  #   memory and tail latency would otherwise grow with every request
  #   interleaved. The others wait for a slot, first come first served,
  #   their connections accepted.
  # - HTTP/1.1 keep-alive (and HTTP/1.0's `Connection: keep-alive`), chunked
  #   request bodies, `Expect: 100-continue`, streaming bodies (`each` and
  #   `call(stream)`, chunked when there is no Content-Length), HEAD.
  # - Parsing is llhttp's C parser (the `llhttp` gem); {Limits} bound what a
  #   client may send, and refused requests get 400/408/413/414/431/505 and
  #   a closed connection.
  # - `rack.hijack`, full and partial: an Upgrade or CONNECT request reaches
  #   the app, which may take the socket (a WebSocket handshake); if it does
  #   not, the connection closes after its response. A hijacked socket is
  #   the app's: the server neither counts nor closes it, also on {#stop}; a
  #   task the app spawns to serve it keeps {#run} from returning until it
  #   ends. An upgrade whose client sent more bytes right behind it (in the
  #   same read) is refused with 400, since those bytes could not reach the
  #   app (see {Parser}).
  # - An access log, off by default (`access_log:`, see {AccessLog}).
  # - TLS on `ssl://HOST:PORT?cert=PATH&key=PATH` binds ({TLS}): each
  #   handshake in its connection's fiber, bounded by `header_timeout`,
  #   holding no request slot; `rack.url_scheme` is "https" there.
  class Server
    # SERVER_SOFTWARE in the env.
    SOFTWARE = "NeverBlock/#{VERSION}"

    # The Rack env key of a callable an app calls when the rest of its request
    # only waits (for another request's answer, a long poll, a stream's next
    # event): the request gives its request slot back, so that it no longer
    # counts against `fiber_pool` or the adaptive limit, and is answered
    # without one. Returns true if it held a slot. Like Puma 8's
    # `env["puma.mark_as_io_bound"]`; absent under other servers, so call it
    # as `env["neverblock.mark_as_io_bound"]&.call` or through
    # {Server.mark_as_io_bound}. A request that computes after calling it
    # computes unlimited: call it where only waiting is left.
    MARK_AS_IO_BOUND = "neverblock.mark_as_io_bound"

    # Marks the request of `env` IO-bound (see {MARK_AS_IO_BOUND}); does
    # nothing outside NeverBlock::Server.
    # @param env [Hash] a Rack env.
    # @return [Boolean] whether the request gave a slot back.
    def self.mark_as_io_bound(env)
      callback = env[MARK_AS_IO_BOUND]
      callback ? callback.call : false
    end

    # @api private
    # @return [String] "1 worker", "4 workers" (for logs and titles).
    def self.workers_phrase(count)
      "#{count} worker#{'s' unless count == 1}"
    end

    # Seconds a stopping server keeps idle keep-alive connections open for a
    # request already on its way (see {#stop}).
    STOP_IDLE_GRACE = 1.0


    # @return [#call] the Rack app.
    attr_reader :app

    # @return [Limits]
    attr_reader :limits

    # @param app [#call] a Rack 3 app.
    # @param bind [Array<String>, String] `tcp://HOST:PORT` (port 0 picks one) or `unix://PATH`.
    # @param workers [Integer] processes to fork and serve in; 0 serves in this
    #   process (no master). With workers, {#run} is the master: it binds,
    #   forks, respawns workers that die and handles signals (see {Cluster}).
    # @param fiber_pool [Integer] the most requests answered at once, each
    #   from the end of its head until its response is written; idle
    #   keep-alive connections, and connections still sending a head, do
    #   not count. Open connections are bounded by
    #   `max_connections` (see {Limits}).
    # @param adaptive_limit [Boolean, Hash] true (the default): admit at
    #   most {ConcurrencyLimit#limit} requests at once, a limit that follows
    #   the event loop's lag between its `min` and `fiber_pool`; a Hash sets
    #   its options (`min:`, `initial:`, `target_lag:` seconds, see
    #   {ConcurrencyLimit#initialize}); false: admit up to `fiber_pool`
    #   whatever the load.
    # @param before_fork [#call, nil] called in the master before the first
    #   worker is forked (close what children must not share).
    # @param on_worker_boot [#call, nil] called with the worker index in each
    #   worker before it accepts (open per-process resources; load the app
    #   when it was not preloaded). An exception fails the worker's boot.
    # @param before_worker_shutdown [#call, nil] called with the worker index
    #   in each worker that stops, once its requests are answered, before it
    #   exits (Puma's `before_worker_shutdown`).
    # @param after_worker_exit [#call, nil] called in the master with the
    #   index and Process::Status of every worker that exits (Puma's
    #   `after_worker_shutdown`).
    # @param on_booted [#call, nil] called once in the master when every
    #   worker accepts for the first time (with `workers: 0`, once the
    #   process accepts).
    # @param on_restart [#call, nil] called in the master when a rolling
    #   restart (USR2, {#restart}) begins.
    # @param worker_timeout [Numeric, nil] seconds a worker's loop may stay
    #   held by one fiber before the master kills and replaces it (see
    #   {Cluster::Settings}; default 60, nil: never).
    # @param worker_boot_timeout [Numeric, nil] seconds a new worker may
    #   take to accept (default `worker_timeout`).
    # @param max_requests [Integer, nil] replace a worker after this many
    #   requests (plus `max_requests_jitter`), the new one booted first.
    # @param max_requests_jitter [Integer, nil] default `max_requests / 10`.
    # @param max_memory [Integer, nil] bytes; replace a worker that uses more
    #   (`memory_metric` :rss or :pss), the new one booted first.
    # @param memory_metric [Symbol] `:rss` (default) or `:pss`.
    # @param supervise [Array<String, Array<String>>] commands a master keeps
    #   running beside its workers (restarted when they exit, stopped with
    #   TERM when it stops), like Solid Queue's `"bin/jobs"`; see
    #   {Cluster::Sidecars}. Ignored, with a warning, with `workers: 0`.
    # @param control [String, nil] `tcp://HOST:PORT` or `unix://PATH`: the
    #   master's control listener (`/metrics`, `/stats`, `/tasks`, commands;
    #   see {Cluster::Control}); nil (the default): none.
    # @param control_token [String, nil] what a TCP control listener wants
    #   (default: one is made and logged).
    # @param status_path [String, nil] a path (like `"/_neverblock/status"`)
    #   answered by the server itself with {#stats} as JSON, for GET only;
    #   nil (the default) answers nothing there.
    # @param access_log_format [Symbol, #call] `:common` (the default),
    #   `:json` (one object per line, with the request id, admission wait,
    #   worker and queue time), or a callable given each entry's Hash that
    #   returns the line (see {AccessLog}).
    # @param access_log [nil, false, true, IO, Logger] one line per request
    #   (see {AccessLog}); true logs to `$stdout`; nil or false (the default): none.
    # @param early_hints [Boolean] give HTTP/1.1 requests `env["rack.early_hints"]`
    #   (Rack 3; Rails' `request.send_early_hints` and its preload links call
    #   it), which sends `103 Early Hints` ahead of the response. Off by
    #   default, as in Puma: once the key is there Rails sends a 103 for
    #   every page with preload links, and a proxy or client written before
    #   1xx hints (RFC 8297) may take it for the final response.
    # @param opentelemetry [Boolean] a span per request (kind :server, the
    #   `traceparent` request's child, current while the app runs; see
    #   {Telemetry::RequestTracer}). Needs the app to load OpenTelemetry's
    #   API (its SDK to export); off by default, since an app that uses
    #   opentelemetry-instrumentation-rack has its own.
    # @param limits [Hash] see {Limits}: `max_request_target:`, `max_header_bytes:`,
    #   `max_headers:`, `max_body:`, `max_body_in_memory:`, `max_connections:`,
    #   `header_timeout:`, `body_timeout:`, `idle_timeout:`, `write_timeout:`,
    #   `shutdown_timeout:`, `request_timeout:` (seconds from the end of a
    #   request's head to the end of its response; past it the request is
    #   unwound at its next wait and answered 503; nil, the default: none).
    # @raise [ArgumentError] for an invalid bind spec or option.
    def initialize(app, bind: ["tcp://0.0.0.0:9292"], workers: Etc.nprocessors, fiber_pool: 1000,
                   adaptive_limit: true, before_fork: nil, on_worker_boot: nil, before_worker_shutdown: nil,
                   after_worker_exit: nil, on_booted: nil, on_restart: nil, status_path: nil, access_log: nil, access_log_format: :common,
                   worker_timeout: 60, worker_boot_timeout: nil, max_requests: nil, max_requests_jitter: nil,
                   max_memory: nil, memory_metric: :rss, supervise: [], control: nil, control_token: nil, early_hints: false,
                   opentelemetry: false, **limits)
      raise ArgumentError, "app must respond to call" unless app.respond_to?(:call)
      raise ArgumentError, "early_hints must be true or false, got #{early_hints.inspect}" unless [true, false].include?(early_hints)
      raise ArgumentError, "opentelemetry must be true or false, got #{opentelemetry.inspect}" unless [true, false].include?(opentelemetry)

      @app = app
      @workers = NeverBlock.validate_size!(workers, :workers, minimum: 0)
      @hooks = { before_fork: before_fork, on_worker_boot: on_worker_boot, before_worker_shutdown: before_worker_shutdown,
                 after_worker_exit: after_worker_exit, on_booted: on_booted, on_restart: on_restart }
      @hooks.each { |name, hook| raise ArgumentError, "#{name} must respond to call" unless hook.nil? || hook.respond_to?(:call) }
      @hooks.freeze
      @supervision = Cluster::Settings.build(worker_timeout: worker_timeout, worker_boot_timeout: worker_boot_timeout,
                                             max_requests: max_requests, max_requests_jitter: max_requests_jitter,
                                             max_memory: max_memory, memory_metric: memory_metric, supervise: supervise,
                                             control: control, control_token: control_token)
      if @workers.zero? && @supervision.supervise.any?
        NeverBlock.logger.warn("NeverBlock::Server: supervise needs a master (workers: 1 or more); with workers: 0 " \
                               "nothing runs #{@supervision.supervise.map { |command| Array(command).join(' ') }.join(', ')}")
      end
      if status_path
        raise ArgumentError, "status_path must start with /, got #{status_path.inspect}" unless status_path.to_s.start_with?("/")

        @app = StatusEndpoint.new(app, self, status_path.to_s)
      end
      @cluster = nil
      @worker_index = nil
      @on_ready = nil
      @heartbeat = nil # [seconds, callable] while a worker of a Cluster
      @beats = nil # the task calling it
      @metrics = nil # Metrics, when the master serves /metrics
      @probe = nil # the task measuring the loop's lag for it
      @commands = nil # [IO, callable]: the master's commands to a worker
      @command_reader = nil # the task reading them
      @systemd = nil # Systemd::Notifier, with workers: 0 under systemd
      @watchdog_pings = nil # its task
      @access_log = AccessLog.build(access_log, format: access_log_format)

      @limits = Limits.build(limits)
      @admission = Admission.new(size: fiber_pool, adaptive_limit: adaptive_limit, on_release: self)
      @sweeper = nil # the task running the IdleSweeper, while serving
      @listeners = Array(bind).map { |spec| Listener.new(spec) }
      raise ArgumentError, "bind needs at least one address" if @listeners.empty?

      @connections = {}.compare_by_identity
      # What every connection gets (see Context).
      @context = Context.new(app: @app, limits: @limits, admission: @admission, access_log: @access_log,
                             idle_sweeper: IdleSweeper.new(@limits.idle_timeout),
                             on_hijack: method(:connection_hijacked), on_close: method(:finish),
                             early_hints: early_hints,
                             opentelemetry: opentelemetry)
      @pool = nil
      @scheduler = nil
      @waiters = [] # acceptors waiting for room
      @turn_waiters = 0 # acceptors waiting for a turn for a slot (#wait_turn)
      @starting = 0 # connections accepted whose fibers have not started yet
      @accept_failed_at = nil
      @stop_requested = false
      @wake_reader, @wake_writer = IO.pipe
    end

    # Opens the listening sockets (at once; {#run} does it too) and returns
    # where they listen, with the real port for a port-0 bind.
    # @return [Array<String>] like `["tcp://127.0.0.1:34567"]`.
    def bound_addresses
      listen_all.map(&:address)
    end

    # Serves until {#stop}. With `workers: 0` it runs its own NeverBlock
    # loop on this thread (or, called inside a running loop, in it) and
    # returns once the listeners are closed and in-flight requests have
    # finished or been cancelled after `shutdown_timeout`. With workers it is
    # the master of a {Cluster} and returns when every worker has exited.
    # @param handle_signals [Boolean] with `workers: 0`, stop gracefully on
    #   TERM and INT while running (a master always does).
    # @return [void]
    # @raise [Error] when the server already ran (a Server runs once), or
    #   when workers are asked for inside a running NeverBlock loop.
    def run(handle_signals: false)
      raise Error, "this NeverBlock::Server has already run; create a new one" if @wake_reader.closed?
      return serve_here_handling_signals if @workers.zero? && handle_signals
      return serve_here if @workers.zero?

      begin
        Cluster.new(self, @workers, @listeners, @supervision).run
      ensure
        @cluster = nil
        @listeners.each(&:close)
        @wake_reader.close
        @wake_writer.close
      end
    end

    # @return [Integer] worker processes (0: serves in the calling process).
    attr_reader :workers

    # A master always handles its signals ({Cluster}); in one process, with
    # `handle_signals: true`, TERM and INT stop the server gracefully while
    # it runs (what a command-line server wants), QUIT logs a {#task_dump},
    # and the previous handlers come back afterwards.
    def serve_here_handling_signals
      previous = %w[TERM INT].to_h { |name| [name, trap(name) { stop }] }
      previous["QUIT"] = trap("QUIT") { log_task_dump }
      begin
        serve_here
      ensure
        previous.each { |name, handler| trap(name, handler || "DEFAULT") }
      end
    end
    private :serve_here_handling_signals

    # @api private
    # Serves in this process until {#stop} (a worker's whole life).
    # @return [void]
    def serve_here
      raise Error, "this NeverBlock::Server has already run; create a new one" if @wake_reader.closed?

      listen_all
      RailsIntegration.before_serving
      NeverBlock.run do
        @scheduler = NeverBlock.current_scheduler!
        @admission.start
        @pool = FiberPool.new(size: @limits.max_connections, queue_limit: 0) # keeps FiberPool::IDLE_LIMIT fibers after a burst
        @accepting = {}
        # Before the acceptors: a connection already in the backlog is served at once.
        @sweeper = NeverBlock.spawn { @context.idle_sweeper.run }
        if (idle_set = IdleSet.build(method(:resume)))
          @context.idle_set = idle_set
          @idle_watch = NeverBlock.spawn { idle_set.run }
          @brief_watch = NeverBlock.spawn { idle_set.brief_waits.run }
        elsif ENV[IdleSet::SWITCH] != "off" && (reason = IdleSet.missing_reason)
          # Not when switched off: the operator chose that, and a log that
          # should stay empty would get a line from every worker.
          NeverBlock.logger.debug("NeverBlock::Server") { "idle keep-alive connections each keep a fiber: #{reason}" }
        end
        acceptors = @listeners.map { |listener| NeverBlock.spawn { accept_loop(listener) } }
        @receiver = NeverBlock.spawn { receive_handoffs } if take_part_in_handoff
        @beats = NeverBlock.spawn { beat(*@heartbeat) } if @heartbeat
        @probe = NeverBlock.spawn { @metrics.probe_loop_lag } if @metrics
        @command_reader = NeverBlock.spawn { read_commands(*@commands) } if @commands
        @on_ready&.call
        if @workers.zero?
          call_hook(:on_booted)
          notify_systemd
        end
        @wake_reader.wait_readable until @stop_requested
        shutdown(acceptors)
      end
    ensure
      @access_log&.flush
      @listeners.each(&:close)
      @wake_reader.close
      @wake_writer.close
    end

    # Stops the server: no new connections; idle keep-alive connections are
    # closed after up to {STOP_IDLE_GRACE} seconds in which a request that
    # was already on its way is still answered (with `connection: close`);
    # requests in flight finish (their connections then close) for
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
      @context.stopping?
    end

    # In a worker (or with `workers: 0`): this process's connections,
    # requests, fiber pool and the database pools that have connections
    # ({ConnectionPool.active}). In the master of a {Cluster}: its workers.
    # `connections` are open ones (at most `max_connections`), of which
    # `idle_connections` wait for their next request's first bytes;
    # `requests_in_flight` are in the app or having their response
    # written; `requests_timed_out` outlived `request_timeout`;
    # `handed_off` counts the connections this worker moved to a less busy
    # sibling ({Handoff});
    # `fiber_pool` is `{size:, limit:, busy:, queued:}`: the `fiber_pool` request slots, how many of them may be taken now (the
    # adaptive limit, else `size`), those taken (from the end of a
    # request's head to its response's end) and the complete heads waiting
    # for one; `adaptive_limit` is {ConcurrencyLimit#stats} (nil when
    # disabled); and `connection_fibers` is {FiberPool#stats} of the
    # connections' fibers. The last keys are {RailsIntegration.server_stats}.
    # @return [Hash] `{pid:, worker:, connections:, idle_connections:,
    #   requests_in_flight:, requests_total:, requests_timed_out:, handed_off:, fiber_pool:, adaptive_limit:, connection_fibers:,
    #   database_pools:, active_record_pools:}` (connection_fibers nil when
    #   not running); or {Cluster#stats} in the master.
    def stats
      return @cluster.stats if @cluster

      { pid: Process.pid, worker: @worker_index, connections: @connections.size,
        idle_connections: @connections.each_key.count(&:idle?),
        requests_in_flight: @context.requests_in_flight, requests_total: @context.requests_total,
        requests_timed_out: @context.requests_timed_out, handed_off: @context.handed_off,
        **@admission.stats,
        connection_fibers: @pool&.stats,
        database_pools: ConnectionPool.active.map { |pool| { name: pool.name, **pool.stats } },
        **RailsIntegration.server_stats }
    end

    # @api private
    # @return [Hash{Symbol => #call, nil}] `before_fork`, `on_worker_boot`.
    attr_reader :hooks

    # @api private
    attr_writer :cluster, :worker_index, :on_ready

    # @api private
    # The master's {Handoff}, given to a forked worker ({Cluster::Worker}):
    # the worker takes part in it while serving.
    attr_writer :handoff

    # @api private
    # A worker's heartbeat: while serving, `callable` is called with the
    # requests started so far every `seconds`, from a task of the loop, so
    # that it stops when the loop stops turning ({Cluster::Worker}).
    # @param value [Array(Numeric, #call), nil]
    attr_writer :heartbeat

    # @api private
    # Opens the listening sockets (or takes those systemd passed, see
    # {Systemd}); a passed socket that no bind address names gets a listener
    # of its own.
    # @return [Array<Listener>]
    def listen_all
      @listeners.each(&:listen)
      Systemd.unclaimed.each { |server| @listeners << Listener.adopt(server) }
      @listeners
    end

    # @api private
    # The command line a master executes again on HUP (a hot restart, see
    # {Cluster::HotRestart}), and the directory to run it in; set by
    # `neverblock serve`, nil otherwise (HUP is then refused with a warning).
    # @return [Array(Array<String>, String), nil]
    attr_accessor :restart_command

    # @api private
    # @return [Cluster::Settings] how a master supervises its workers.
    attr_reader :supervision

    # @api private
    # A worker whose master serves `/metrics` counts its requests
    # ({Metrics}); set before {#serve_here}.
    # @param metrics [Metrics]
    def metrics=(metrics)
      @metrics = metrics
      @context.metrics = metrics
      @admission.metrics = metrics
    end

    # @api private
    # The master's commands to a worker: each line read from `io` is
    # passed to `callable` in a task of the loop, while serving.
    # @param value [Array(IO, #call)]
    attr_writer :commands

    # @api private
    # @return [Hash, nil] {Metrics#snapshot} (nil without metrics).
    def metrics_snapshot
      @metrics&.snapshot(stats, @scheduler)
    end

    # What this process's tasks are doing: the one holding the loop and
    # every request in flight with its backtrace ({TaskDump}). Safe from
    # any thread; meant for one other than the loop's, which may be stuck.
    # @return [String] several lines; one saying so when not serving.
    def task_dump
      scheduler = @scheduler
      unless scheduler && !@wake_reader.closed?
        return "not serving (yet); the main thread is here:\n    #{(Thread.main.backtrace || []).first(TaskDump::FRAMES).join("\n    ")}"
      end

      TaskDump.new(scheduler, @connections.keys).to_s
    end

    # @api private
    # Logs {#task_dump} from a thread of its own (a signal handler may not
    # take the logger's lock, and the loop may be stuck), then calls `after`
    # there.
    # @return [Thread]
    def log_task_dump(after = nil)
      Thread.new do
        NeverBlock.logger.warn { "NeverBlock::Server: #{@worker_index ? "worker #{@worker_index} " : ''}(pid #{Process.pid}) tasks:\n#{task_dump}" }
      ensure
        after&.call
      end
    end

    # @api private
    # Calls the hook `name` with `args`; one that raises is logged, not
    # let through (a master, or a stopping worker, must go on).
    # @return [void]
    def call_hook(name, *args)
      @hooks[name]&.call(*args)
    rescue StandardError => e
      NeverBlock.logger.error { "NeverBlock::Server: the #{name} hook raised #{e.class}: #{e.message}\n#{(e.backtrace || []).first(10).join("\n")}" }
    end

    # @api private
    # Gives a forked worker a wake pipe of its own. The one made in
    # #initialize is inherited by every worker: one worker's {#stop} would
    # leave its byte there for all of them, and each one's loop in
    # {#serve_here} would find the pipe readable forever (a busy loop).
    # Call before the worker's stop signal handlers are installed.
    # @return [void]
    def own_wake_pipe
      @wake_reader.close
      @wake_writer.close
      @wake_reader, @wake_writer = IO.pipe
    end

    # @api private
    # @return [AccessLog, nil]
    attr_reader :access_log

    # A request slot (from {Admission#release}) or a connection was given
    # back: acceptors waiting for room look again.
    # @api private
    # @return [void]
    def room_freed
      @waiters.each { |fiber| @scheduler.wake(fiber) } unless @waiters.empty?
    end

    # Connections the acceptors leave in the kernel's accept queues while
    # they wait for room: demand the adaptive limit counts like requests
    # waiting for a slot ({Admission}). A listener whose queue cannot be read
    # (a unix socket) counts as one while its acceptor waits.
    # @api private
    # @return [Integer]
    def pending_connections
      return 0 if @waiters.empty? && @turn_waiters.zero?

      @listeners.sum { |listener| listener.pending_connections || 1 }
    end

    private

    # The app took the connection's socket (rack.hijack, see
    # Context#hijacked): it is no longer the server's to count, and the
    # server will not close it.
    def connection_hijacked(connection)
      @connections.delete(connection)
      @context.idle_sweeper.forget(connection)
      room_freed
    end

    # Accepts while there is room: fewer than `max_connections` open (and
    # a free fiber for one) and a free request slot. A connection's fiber
    # starts on the loop's next turn (FiberPool#spawn(defer: true)), so the
    # acceptor takes in the backlog on one turn instead of one connection a
    # turn (15 a second when each turn runs 64 one-millisecond requests,
    # while the rest waited in the backlog for seconds). The only worker of
    # the listener takes in all it has room for; beside other workers, its
    # free slots or its share of the backlog, once the first has run
    # (#take_in_after_first). When the slots are all taken it waits for a
    # turn among the requests waiting for one (#wait_turn) and then takes
    # in one connection, or, as the only worker, every connection waiting
    # by then: their requests queue behind those already waiting. With no
    # room for a connection it waits until one ends. None is
    # dropped. Only its waits (for room, for a connection) may be
    # interrupted by {#shutdown}: it never waits while it holds an accepted
    # socket.
    def accept_loop(listener)
      until stopping?
        @accepting[listener] = true
        begin
          turn = wait_for_room
          socket = accept_now(listener)
          listener.wait_readable unless socket
        ensure
          @accepting.delete(listener)
        end
        next unless socket

        serve(socket, listener)
        if alone?
          serve(socket, listener) while turn && !stopping? && room_for_connection? && (socket = accept_now(listener))
        elsif !turn # after a turn its slots are all taken and the one it took waits for a slot already
          take_in_after_first(listener)
        end
      end
    end

    # Beside other workers, having just taken in one connection: lets that
    # connection run to its first wait (its first request answered, if it
    # came with it) before taking in more, then takes in as many as it has
    # free slots for (#room?, counting those not started yet), and at least
    # its share of the backlog (the connections waiting over the workers,
    # rounded up), whose fibers start together on the next turn. A worker
    # that dies on a request (a crash loop, where every worker's first
    # request may be the fatal one) so takes down the connection it died
    # on, not the whole backlog it had taken in first; and its share keeps
    # the backlog moving when requests that never yield have pushed the
    # adaptive limit down to a slot or two. Past its share it stops once a
    # sibling serves {Handoff::MARGIN} fewer connections (#sibling_less_busy?): the
    # rest of the backlog is theirs (keep-alive clients that connect
    # together are spread as they arrive, and the Handoff evens out the rest).
    def take_in_after_first(listener)
      @scheduler.yield
      share = backlog_share(listener)
      while !stopping? && room_for_connection? && (share.positive? || (room? && !sibling_less_busy?)) && (socket = accept_now(listener))
        serve(socket, listener)
        share -= 1
      end
    end

    # Whether a sibling serves {Handoff::MARGIN} fewer connections than this
    # worker (never without a {Handoff}).
    def sibling_less_busy?
      (handoff = @context.handoff) ? handoff.sibling_less_busy? : false
    end

    # This worker's share of the connections waiting in `listener`'s
    # backlog: the backlog over the workers, rounded up (0 where it cannot
    # be read: a unix socket).
    def backlog_share(listener)
      waiting = listener.pending_connections or return 0

      (waiting + @workers - 1) / @workers
    end

    # Out of file descriptors or kernel memory, accept fails and the
    # connection stays in the backlog: wait a little, then try again
    # (logged at most once a second).
    def accept_now(listener)
      listener.accept_now
    rescue Errno::EMFILE, Errno::ENFILE, Errno::ENOBUFS, Errno::ENOMEM => e
      clock = Clock.now
      if @accept_failed_at.nil? || clock - @accept_failed_at >= 1
        @accept_failed_at = clock
        NeverBlock.logger.warn("NeverBlock::Server: accept failed (#{e.message}) with #{@connections.size} " \
                               "connections open; lower max_connections or raise the open-file limit (ulimit -n)")
      end
      NeverBlock.sleep(0.1)
      nil
    end

    def room?
      !@admission.full? && room_for_connection? && (alone? || @admission.taken + @starting < @admission.limit)
    end

    # Whether this is the listener's only worker (none beside it to leave
    # connections in the backlog to).
    def alone?
      @workers <= 1
    end

    def room_for_connection?
      @connections.size < @limits.max_connections && !@pool.full?
    end

    # The request slots are all taken, but there is room for a connection:
    # waits for a turn among the requests waiting for a slot
    # (Admission#wait_turn), so connections in the accept queue are not
    # starved by the keep-alive connections already accepted. Counted as an
    # acceptor waiting for room (#pending_connections) meanwhile.
    def wait_turn
      @turn_waiters += 1
      @admission.wait_turn
      true
    ensure
      @turn_waiters -= 1
    end


    # Returns whether it waited a turn (#wait_turn) rather than for room.
    def wait_for_room
      return false if room?
      return wait_turn if @admission.full? && room_for_connection?

      fiber = Fiber.current
      @waiters << fiber
      @scheduler.wait_until { room? }
      false
    ensure
      @waiters.delete(fiber) if fiber
    end

    def serve(socket, listener)
      connection = Connection.new(@context, socket, listener)
      @connections[connection] = true
      spawned = false
      connection.task = @pool.spawn(defer: true) do # starts on the next turn, after this returns
        spawned = true
        started
        connection.run
      ensure
        finish(connection) unless connection.parked?
      end
      @starting += 1
      @context.handoff&.publish
      # Ruby could not create the fiber (the task failed and was logged).
      unless spawned || connection.task.alive?
        started
        finish(connection)
      end
    rescue StandardError
      raise if spawned

      finish(connection)
      raise
    end

    # A connection's fiber started (or will not): it no longer counts
    # against the slots an acceptor beside other workers may fill (#room?).
    def started
      @starting -= 1
      room_freed
    end

    # The IdleSet found a parked connection's socket readable: a pooled
    # task reads and serves it (or parks it again). The pool has room: it
    # has a fiber for each of `max_connections` connections, and a parked
    # one holds none. The task starts on the loop's next turn, with the
    # others the IdleSet found readable at once (see #accept_loop: one at a
    # time, they would get one a turn). Unless a less busy sibling takes it
    # over first (Connection#hand_off): then it ends here, its socket open
    # in the sibling.
    def resume(connection)
      return finish(connection) if connection.unpark && connection.hand_off

      spawned = false
      connection.task = @pool.spawn(defer: true) do
        spawned = true
        connection.resume
      ensure
        finish(connection) unless connection.parked?
      end
      finish(connection) unless spawned || connection.task.alive?
    rescue StandardError => e
      raise if spawned

      NeverBlock.logger.error("NeverBlock::Server: could not resume an idle connection: #{e.class}: #{e.message}")
      finish(connection)
    end

    # A connection ended (its task's end, or closed while parked): its
    # socket is closed unless the app took it, and there is room for another.
    def finish(connection)
      @connections.delete(connection)
      @context.idle_sweeper.forget(connection)
      connection.close
      @context.handoff&.publish
      room_freed
    end

    # With a {Handoff} from the master (a worker beside others): joins it,
    # counting as active the connections not parked idle.
    # @return [Boolean] whether this worker takes part.
    def take_part_in_handoff
      return false unless @handoff && @worker_index &&
                          @handoff.attach(@worker_index, @listeners, method(:active_connections))

      @context.handoff = @handoff
      @handoff.open
      true
    end

    # Open connections less those parked idle in the {IdleSet} (a connection
    # parked to wait its turn is active); {Handoff::FULL} while there is no
    # room for another connection, so that no sibling picks this worker.
    def active_connections
      return Handoff::FULL unless room_for_connection?

      idle_set = @context.idle_set
      idle_set ? @connections.size - idle_set.size + @context.turns_parked : @connections.size
    end

    # The receiving task of a worker in a {Handoff}: serves each connection a
    # sibling hands over as if it had accepted it, while it has room for a
    # connection (the request slots are not asked: the sibling chose this
    # worker as the least busy, and a request that finds them taken waits
    # for one as any other). It goes on while the worker drains (a stopping
    # worker answers the request a moved connection brought, with
    # `connection: close`), until #take_last_handoffs. If it dies, the slot
    # closes with it.
    def receive_handoffs
      loop do
        unless room_for_connection?
          fiber = Fiber.current
          @waiters << fiber
          begin
            @scheduler.wait_until { room_for_connection? }
          ensure
            @waiters.delete(fiber)
          end
        end
        socket, listener = @handoff.receive
        socket ? serve(socket, listener) : @handoff.wait_readable
      end
    ensure
      @handoff.close
    end

    # At the end of the drain: the receiver stops, and what siblings sent
    # before this worker closed its slot is served too (each connection
    # brought a request; it is answered with `connection: close`). What
    # comes later (a sibling that read the slot just before it closed) is
    # the index's successor's, or, if none comes, waits in the pair until
    # the master exits.
    def take_last_handoffs
      return unless @receiver

      @receiver.cancel
      while (received = @handoff.receive)
        room_for_connection? ? serve(*received) : received.first.close
      end
    end

    def shutdown(acceptors)
      @context.stopping = true
      @context.handoff&.close # siblings send no more; the receiver takes up what they sent (below)
      @systemd&.stopping
      [@beats, @probe, @command_reader, @watchdog_pings].each { |task| task&.cancel }
      @admission.stop
      @listeners.zip(acceptors) { |listener, acceptor| acceptor.cancel if @accepting[listener] }
      acceptors.each(&:wait)
      @listeners.each(&:close)
      drain_idle_connections
      take_last_handoffs
      @connections.keys.each(&:close_if_idle) # a copy: a parked one leaves @connections at once
      # The sweeper last: a connection may begin an idle wait after the
      # above (a TLS handshake that ends now), and then closes in idle_timeout.
      @pool.shutdown(@limits.shutdown_timeout)
      @sweeper&.cancel
      close_idle_set
    end

    # After the pool's shutdown no task serves a connection: any still
    # counted (a resuming task cancelled before it started) is closed here.
    def close_idle_set
      idle_set = @context.idle_set or return

      @idle_watch.cancel
      @brief_watch.cancel
      @connections.keys.each { |connection| finish(connection) }
      idle_set.close
      @context.idle_set = nil
    end

    # A keep-alive client may have sent its next request just as the stop
    # came: closing its idle connection now would lose that request (the
    # client sees EOF or a reset, and must not retry a POST). So idle
    # connections get up to STOP_IDLE_GRACE seconds (at most `idle_timeout`)
    # for a request already on its way, which is answered with
    # `connection: close`; those still idle after that are closed.
    # The heartbeat task: a turn of the loop every `seconds` (a loop held by
    # one fiber cannot run it, which is what the master watches for).
    def beat(seconds, callable)
      loop do
        callable.call(@context.requests_total)
        NeverBlock.sleep(seconds)
      end
    end

    # With `workers: 0` this process is the service systemd watches (a
    # master does it for its workers, see {Cluster}): READY=1 now, STOPPING=1
    # when it stops, and WATCHDOG=1 from a task of the loop.
    def notify_systemd
      @systemd = Systemd::Notifier.new
      return (@systemd = nil) unless @systemd.enabled?

      @systemd.ready("serving on #{@listeners.map(&:address).join(', ')}")
      interval = @systemd.watchdog_interval or return
      @watchdog_pings = NeverBlock.spawn do
        loop do
          @systemd.watchdog
          NeverBlock.sleep(interval)
        end
      end
    end

    def read_commands(io, callable)
      while (line = io.gets)
        callable.call(line.chomp)
      end
    rescue IOError
      nil
    end

    def drain_idle_connections
      deadline = Clock.now + [STOP_IDLE_GRACE, @limits.idle_timeout].min
      while @connections.each_key.any?(&:idle?) && Clock.now < deadline
        NeverBlock.sleep(0.02)
      end
    end
  end
end
