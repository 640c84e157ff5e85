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
require_relative "server/chunked_body"
require_relative "server/body_pace"
require_relative "server/parser"
require_relative "server/response"
require_relative "server/access_log"
require_relative "server/refusal_log"
require_relative "server/metrics"
require_relative "server/request_tracer"
require_relative "server/hangup_watch"
require_relative "server/hangup_log"
require_relative "server/hijacks"
require_relative "server/context"
require_relative "server/start_pace"
require_relative "server/acceptor"
require_relative "server/request_expiry"
require_relative "server/exchange"
require_relative "server/streamed_response"
require_relative "server/parking"
require_relative "server/peer_address"
require_relative "server/connection"
require_relative "server/app_tasks"
require_relative "server/introspection"
require_relative "server/cluster_interface"
require_relative "server/cluster/hot_restart"
require_relative "server/cluster/watchdog"
require_relative "server/cluster/refork"
require_relative "server/cluster/stopping"
require_relative "server/cluster/rollout"
require_relative "server/cluster/counters"
require_relative "server/cluster"
require_relative "server/cluster/child"
require_relative "server/cluster/settings"
require_relative "server/cluster/memory"
require_relative "server/cluster/sidecars"
require_relative "server/cluster/worker"
require_relative "server/cluster/mold"
require_relative "server/task_dump"
require_relative "server/status_endpoint"
require_relative "server/lazy_app"
require_relative "server/heap_warmup"
require_relative "server/herd_gc"
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
  # - Connections are taken in by the {Acceptor}; each is served by a fiber of a bounded {FiberPool} (of
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
  # - Heads are parsed by a C fast path of NeverBlock's own or by llhttp's C
  #   parser (the `llhttp` gem), bodies framed by NeverBlock ({Parser});
  #   {Limits} bound what a client may send, and refused requests get
  #   400/408/413/414/431/505 and a closed connection.
  # - `rack.hijack`, full and partial: an Upgrade or CONNECT request reaches
  #   the app, which may take the socket (a WebSocket handshake); if it does
  #   not, the connection closes after its response. A hijacked socket is
  #   the app's: the server neither reads, writes nor counts it; it closes
  #   it only to end the request's work that serves it ({Hijacks}: at
  #   `request_timeout` unless the app opts out with {HIJACK_TIMEOUT}, when
  #   the client hangs up, at a stop after `shutdown_timeout`). A socket the
  #   app hands out of the request's task tree (a thread of its own) is left
  #   to it, also on {#stop}; a task the app spawns detached to serve it runs
  #   until it ends, or until {#stop} cancels it after the drain ({AppTasks}).
  #   An upgrade whose client sent more bytes right behind it, before
  #   its response, is refused with 400, since those bytes could not reach
  #   the app (see {Parser}).
  # - An access log, off by default (`access_log:`, see {AccessLog}).
  # - TLS on `ssl://HOST:PORT?cert=PATH&key=PATH` binds ({TLS}): each
  #   handshake in its connection's fiber, bounded by `header_timeout`,
  #   holding no request slot; `rack.url_scheme` is "https" there.
  class Server
    include Introspection
    include ClusterInterface

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

    # The Rack env key an app sets to false (`env["neverblock.hijack_timeout"]
    # = false`) before its call returns, to keep `request_timeout` from
    # closing the socket it hijacked (a WebSocket meant to outlive it) and
    # cancelling the tasks it spawned to serve it ({Hijacks}). The call
    # itself is bounded all the same.
    HIJACK_TIMEOUT = "neverblock.hijack_timeout"

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
    # @param before_refork [#call, nil] called with its worker index in a
    #   worker promoted to mold ({Cluster::Refork}), once it stopped serving
    #   and before it forks the next generation (close what children must
    #   not share; NeverBlock's and ActiveRecord's pools are closed already).
    # @param refork_after [Array<Integer>, nil] request counts: a worker
    #   that served the first is promoted to mold and the next generation
    #   of workers is forked from it; the next count is for that generation,
    #   the last repeats unless it is `false` ({Cluster::Settings}). Linux
    #   only (ArgumentError elsewhere).
    # @param refork_when [#call, nil] called with its index in each worker,
    #   on its loop, until it returns true: the worker is warm (its caches
    #   built), and only a warm worker is promoted for `refork_after`
    #   ({Cluster::Settings}); nil (the default): every worker is.
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
    #   {RequestTracer}). Needs the app to load OpenTelemetry's
    #   API (its SDK to export); off by default, since an app that uses
    #   opentelemetry-instrumentation-rack has its own.
    # @param cancel_on_hangup [Boolean] cancel a request whose client hangs
    #   up while the app handles it, with what it spawned and the queries
    #   they wait on ({HangupWatch}; logged 499). On by default; off, as
    #   nginx's proxy_ignore_client_abort, such a request runs to its end.
    # @param limits [Hash] see {Limits}: `max_request_target:`, `max_header_bytes:`,
    #   `max_headers:`, `max_body:`, `max_body_in_memory:`, `max_connections:`,
    #   `header_timeout:`, `body_timeout:`, `idle_timeout:`, `write_timeout:`,
    #   `shutdown_timeout:`, `request_timeout:` (seconds from the end of a
    #   request's head to the end of its response; past it the request is
    #   unwound at its next wait and answered 503; nil, the default: none).
    # @raise [ArgumentError] for an invalid bind spec or option.
    def initialize(app, bind: ["tcp://0.0.0.0:9292"], workers: Etc.nprocessors, fiber_pool: 1000,
                   adaptive_limit: true, before_fork: nil, on_worker_boot: nil, before_worker_shutdown: nil,
                   after_worker_exit: nil, on_booted: nil, on_restart: nil, before_refork: nil, refork_after: nil,
                   refork_when: nil, status_path: nil, access_log: nil, access_log_format: :common,
                   worker_timeout: 60, worker_boot_timeout: nil, max_requests: nil, max_requests_jitter: nil,
                   max_memory: nil, memory_metric: :rss, supervise: [], control: nil, control_token: nil, early_hints: false,
                   opentelemetry: false, cancel_on_hangup: true, **limits)
      raise ArgumentError, "app must respond to call" unless app.respond_to?(:call)
      raise ArgumentError, "early_hints must be true or false, got #{early_hints.inspect}" unless [true, false].include?(early_hints)
      raise ArgumentError, "opentelemetry must be true or false, got #{opentelemetry.inspect}" unless [true, false].include?(opentelemetry)
      unless [true, false].include?(cancel_on_hangup)
        raise ArgumentError, "cancel_on_hangup must be true or false, got #{cancel_on_hangup.inspect}"
      end

      @app = app
      @workers = NeverBlock.validate_size!(workers, :workers, minimum: 0)
      @hooks = { before_fork: before_fork, on_worker_boot: on_worker_boot, before_worker_shutdown: before_worker_shutdown,
                 after_worker_exit: after_worker_exit, on_booted: on_booted, on_restart: on_restart,
                 before_refork: before_refork }
      @hooks.each { |name, hook| raise ArgumentError, "#{name} must respond to call" unless hook.nil? || hook.respond_to?(:call) }
      @hooks.freeze
      @supervision = Cluster::Settings.build(worker_timeout: worker_timeout, worker_boot_timeout: worker_boot_timeout,
                                             max_requests: max_requests, max_requests_jitter: max_requests_jitter,
                                             max_memory: max_memory, memory_metric: memory_metric, supervise: supervise,
                                             control: control, control_token: control_token, refork_after: refork_after,
                                             refork_when: refork_when)
      if @workers.zero? && @supervision.supervise.any?
        NeverBlock.logger.warn("NeverBlock::Server: supervise needs a master (workers: 1 or more); with workers: 0 " \
                               "nothing runs #{@supervision.supervise.map { |command| Array(command).join(' ') }.join(', ')}")
      end
      NeverBlock.logger.warn("NeverBlock::Server: refork_after needs workers (1 or more); with workers: 0 nothing reforks") if @workers.zero? && @supervision.refork_after.any?
      if status_path
        raise ArgumentError, "status_path must start with /, got #{status_path.inspect}" unless status_path.to_s.start_with?("/")

        @app = StatusEndpoint.new(app, method(:stats), status_path.to_s)
      end
      @cluster = nil
      @worker_index = nil
      @on_ready = nil
      @metrics = nil # Metrics, when the master serves /metrics
      @systemd = nil # Systemd::Notifier, with workers: 0 under systemd
      @access_log = AccessLog.build(access_log, format: access_log_format)

      @limits = Limits.build(limits)
      @listeners = Array(bind).map { |spec| Listener.new(spec) }
      raise ArgumentError, "bind needs at least one address" if @listeners.empty?

      @request_path = { fiber_pool: fiber_pool, adaptive_limit: adaptive_limit, early_hints: early_hints,
                        opentelemetry: opentelemetry, cancel_on_hangup: cancel_on_hangup }.freeze
      assemble
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
    # returns once the listeners are closed, in-flight requests have
    # finished or been cancelled after `shutdown_timeout`, and what they
    # left running (detached tasks) was cancelled and has ended. With
    # workers it is the master of a {Cluster} and returns when every worker
    # has exited.
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
      graceful = proc { stop }
      Cluster.trapping("TERM" => graceful, "INT" => graceful, "QUIT" => proc { log_task_dump }) { serve_here }
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
        @serving_task = NeverBlock.current_task # for TaskDump: the server's own
        @admission.start
        # Before the acceptors: a connection already in the backlog is served at once.
        @sweeper = NeverBlock.spawn(detached: true, internal: true) { @context.idle_sweeper.run }
        @acceptor.start(joined_handoff)
        @serving_tasks = @serving_jobs.map { |job| NeverBlock.spawn(detached: true, internal: true, &job) }
        @serving_tasks << NeverBlock.spawn(detached: true, internal: true) { @metrics.probe_loop_lag } if @metrics
        @serving_tasks << NeverBlock.spawn(detached: true, internal: true) { @context.hangup_watch.run } if @context.hangup_watch
        @on_ready&.call
        if @workers.zero?
          call_hook(:on_booted)
          @systemd = Systemd::Notifier.serving("serving on #{@listeners.map(&:address).join(', ')}")
        end
        @wake_reader.wait_readable until @stop_requested
        shutdown
      end
    ensure
      @access_log&.flush
      HerdGC.reset # the loop's end, a stop's or an exception's: a hold's timers fire no more
      @listeners.each(&:close) unless @keep_listeners
      @wake_reader.close
      @wake_writer.close
    end

    # Stops the server: no new connections; idle keep-alive connections are
    # closed after up to {STOP_IDLE_GRACE} seconds in which a request that
    # was already on its way is still answered (with `connection: close`);
    # requests in flight finish (their connections then close) for
    # up to `shutdown_timeout` seconds and are cancelled after that. Then
    # the tasks the requests left running (spawned `detached: true`, a
    # `Fiber.schedule` fiber, those serving a hijacked socket) are cancelled,
    # each logged with where it was spawned, and waited for within what is
    # left of `shutdown_timeout` (at least {AppTasks::LEAST_WAIT} seconds;
    # one still running then is logged with its backtrace, and still waited
    # for). {#run} then returns. Safe from any thread and from a signal
    # handler.
    # @param last [Boolean] (a worker's) the whole server stops, so what
    #   the kernel queued is taken in and answered before the listeners
    #   close ({Acceptor#take_backlog}); a worker replaced in a restart
    #   leaves it to the others. Always so with `workers: 0`.
    # @return [void]
    def stop(last: false)
      return @cluster.stop if @cluster

      @last_stop = true if last
      @stop_requested = true
      @wake_writer.write_nonblock(".", exception: false)
    rescue IOError
      nil
    end

    # @return [Boolean] true once {#stop} has been acted on.
    def stopping?
      @context.stopping?
    end

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

    private

    # The request path, new (see {#renew}): what admits requests, accepts
    # connections and what every connection gets ({Context}).
    def assemble
      options = @request_path
      @admission = Admission.new(size: options[:fiber_pool], adaptive_limit: options[:adaptive_limit])
      @sweeper = nil # the task running the IdleSweeper, while serving
      @app_tasks = AppTasks.new # what the app leaves running past its requests
      @acceptor = Acceptor.new(@admission, @limits, @listeners, @workers, @app_tasks)
      @acceptor.context = @context = Context.new(app: @app, limits: @limits, admission: @admission, access_log: @access_log,
                                                 idle_sweeper: IdleSweeper.new(@limits.idle_timeout), acceptor: @acceptor,
                                                 early_hints: options[:early_hints], opentelemetry: options[:opentelemetry],
                                                 cancel_on_hangup: options[:cancel_on_hangup])
      @serving_jobs = [] # blocks run in tasks of their own while serving (#while_serving)
      @serving_tasks = [] # those tasks
      @scheduler = nil
      @serving_task = nil # the task running #serve_here
      @stop_requested = false
      @last_stop = false
    end

    # The stop, in order: no more accepts (at the server's last stop what
    # the kernel queued is taken in, {Acceptor#take_backlog}; the listeners
    # close), idle
    # keep-alive connections get STOP_IDLE_GRACE seconds (at most
    # `idle_timeout`) for a request already on its way, which is answered
    # with `connection: close` (closing them at once would lose it: the
    # client sees EOF or a reset, and must not retry a POST), requests in
    # flight get `shutdown_timeout` seconds ({Acceptor#drain}). Then what
    # the app left running past its requests (a detached poller, the tasks
    # serving hijacked sockets) is cancelled and waited for, within what is
    # left of `shutdown_timeout` counted from the stop's start
    # ({AppTasks#cancel_left}), and the hijacked sockets are closed
    # ({Hijacks#close}): the loop, and so {#run}, ends only when every task
    # has.
    def shutdown
      deadline = Clock.now + @limits.shutdown_timeout
      @context.stopping = true
      @context.handoff&.close # siblings send no more; the Acceptor takes up what they sent
      @systemd&.stopping # (and its watchdog pings end)
      @serving_tasks.each(&:cancel)
      @admission.stop
      @acceptor.stop_accepting
      @acceptor.take_backlog if @last_stop || @workers.zero?
      @listeners.each(&:close) unless @keep_listeners
      @acceptor.drain([STOP_IDLE_GRACE, @limits.idle_timeout].min)
      @context.hijacks.stop # their tasks are among what the app left running
      # The sweeper last: a connection may begin an idle wait after the
      # above (a TLS handshake that ends now), and then closes in idle_timeout.
      @sweeper&.cancel
      @acceptor.close
      @app_tasks.cancel_left(@scheduler, deadline, "NeverBlock::Server:#{" worker #{@worker_index} (pid #{Process.pid})" if @worker_index}")
      @context.hijacks.close
    end
  end
end
