# frozen_string_literal: true

require "json"
require "openssl"
require "securerandom"
require "socket"
require "uri"

module NeverBlock
  class Server
    class Cluster
      # The master's control listener (`control: "tcp://127.0.0.1:9293"` or
      # `"unix:///run/app/control.sock"`; off by default), what `neverblock
      # ctl` talks to, as Puma's control app is what `pumactl` does:
      #
      # - `GET /metrics` :: the whole cluster in Prometheus's text format,
      #   every worker's series labelled `worker` ({Prometheus}), from what
      #   each sent with its last heartbeat ({Metrics}): never one worker's
      #   view, whichever took the connection;
      # - `GET /stats` :: {Cluster#stats} with each worker's metrics and the
      #   cluster's counters since the master started (`totals`), as JSON;
      # - `GET /tasks` :: every worker's {Server#task_dump}, asked for now;
      # - `POST /phased-restart` (USR2: workers one at a time), `/restart`
      #   (HUP: a hot restart, {HotRestart}), `/stop` (TERM), `/halt` (every
      #   worker killed now), `/gc` (a full GC in every worker), `/refork`
      #   (URG: the next generation forks from a warmed-up worker, {Refork}).
      #
      # Loaded only by a master that has one (it needs OpenSSL, ~7 MB of RSS
      # that no other process should pay for).
      #
      # A TCP listener wants the token (`Authorization: Bearer TOKEN` or
      # `?token=TOKEN`): `control_token`, else one made at start and logged.
      # A unix socket is guarded by its file's permissions (0600) instead.
      #
      # It serves on a thread of the master (a slow client must not hold up
      # supervision), one short HTTP/1.0 exchange per connection, reading
      # the master's state only through calls that copy it in one step
      # ({Cluster#children}) and acting through {Cluster#command}, which the
      # master's loop carries out once the answer is sent and the
      # connection closed (a hot restart executes the master again: an
      # answer still to be written would be lost).
      #
      # The master forks workers while this thread may hold a connection,
      # and a forked worker would keep that connection's descriptor open
      # for as long as it lives: its client, reading the answer to its end,
      # would wait forever (`neverblock ctl phased-restart` did, on a loaded
      # machine, when the new worker was forked before the answer's
      # connection was closed). So the master forks inside
      # {#hold_accepts}, during which no connection is accepted, and the
      # worker closes the connection open at that moment with the listener
      # ({#ios}).
      class Control
        # Seconds a client has to send its request.
        READ_TIMEOUT = 5
        # Seconds `/tasks` waits for the workers' answers.
        TASKS_TIMEOUT = 3
        # Longest request head read (bytes).
        MAX_HEAD = 8192

        COMMANDS = { "/phased-restart" => "USR2", "/restart" => "HUP", "/stop" => "TERM", "/halt" => "HALT",
                     "/refork" => "URG" }.freeze

        # @return [String, nil] the token a TCP listener wants.
        attr_reader :token

        # @param cluster [Cluster]
        # @param url [String] see {.validate!}.
        # @param token [String, nil]
        def initialize(cluster, url, token)
          @cluster = cluster
          @listener = Listener.new(url)
          @token = @listener.unix? ? nil : (token || SecureRandom.hex(16))
          @generated = token.nil?
          @thread = nil
          @client = nil # the connection being answered, which a forked worker closes
          @accepting = Thread::Mutex.new # held while a connection is accepted, and around a fork
        end

        # Opens the listener and starts its thread.
        # @return [self]
        def start
          @listener.listen
          File.chmod(0o600, @listener.spec.delete_prefix("unix://")) if @listener.unix?
          # A token made here is said at warn: a quieter log level must not
          # hide the one thing that opens the listener.
          NeverBlock.logger.public_send(@token && @generated ? :warn : :info) do
            "NeverBlock::Server: control listener on #{address}#{" (token #{@token})" if @token && @generated}"
          end
          @thread = Thread.new { serve }
          @thread.name = "neverblock-control"
          self
        end

        # @return [String] where it listens (the real port for port 0).
        def address
          @listener.address
        end

        # @return [Array<IO>] what a forked worker must close: the listener
        #   and the connection being answered when it was forked
        #   ({#hold_accepts}).
        def ios
          [@listener.io, @client].compact
        end

        # Runs the block (the master's fork of a worker) while no
        # connection is being accepted: one accepted in the middle of a fork
        # would be open in the child without the child knowing it. So {#ios}
        # in the child names every descriptor of this listener it holds.
        # Waits at most for one `accept(2)` to return.
        # @return [Object] the block's value.
        def hold_accepts(&block)
          @accepting.synchronize(&block)
        end

        # Closes the listener; its thread ends.
        # @return [void]
        def stop
          io = @listener.io
          @listener.close # (and its unix socket's file)
          @thread&.join(2) if io
        end

        private

        def serve
          loop do
            client = accept or next
            command = request = nil
            begin
              command, request = answer(client)
            rescue StandardError => e
              NeverBlock.logger.warn { "NeverBlock::Server: control request failed: #{e.class}: #{e.message}" }
            ensure
              close(client)
            end
            @cluster.command(command, request) if command
          end
        rescue IOError, SystemCallError
          nil # closed by #stop
        end

        # Waits for a connection and takes it under the lock a fork holds
        # ({#hold_accepts}), so that a forked worker sees it in @client or
        # does not have it at all.
        # @return [IO, nil] nil when the connection went away meanwhile.
        def accept
          @listener.wait_readable
          @accepting.synchronize { @client = @listener.accept_now }
        end

        # Closes the connection under the lock a fork holds: Ruby may mark
        # the IO closed and then close(2) it without the GVL, and a worker
        # forked between the two would not know it holds the connection.
        def close(client)
          @accepting.synchronize do
            client.close
            @client = nil
          end
        end

        # Answers one request.
        # @return [Array(String, String), nil] the command for the master to
        #   carry out now that the answer is written ({COMMANDS}' values), and
        #   the request that asked for it ("POST /phased-restart").
        def answer(client)
          head = read_head(client) or return
          method, target = head.lines.first.to_s.split(" ", 3)
          uri = URI.parse(target.to_s)
          unless (refusal = unauthorized(head, uri)).nil?
            respond(client, 401, refusal)
            return nil
          end

          status, type, body, command = route(method, uri.path)
          respond(client, status, body, type)
          [command, "#{method} #{uri.path}"] if command
        rescue URI::InvalidURIError
          respond(client, 400, "bad request\n")
          nil
        end

        # @return [Array(Integer, String, String, String)] status, content
        #   type, body and, for a command, what {Cluster#command} is to do.
        def route(method, path)
          case [method, path]
          in ["GET", "/metrics"] then [200, "text/plain; version=0.0.4; charset=utf-8", Prometheus.render(@cluster)]
          in ["GET", "/stats"] then [200, "application/json", "#{JSON.generate(stats)}\n"]
          in ["GET", "/tasks"] then [200, "application/json", "#{JSON.generate(tasks)}\n"]
          in ["POST", "/gc"]
            each_worker_command("gc")
            [200, "application/json", %({"gc":"started"}\n)]
          in ["POST", command] if COMMANDS.key?(command)
            [200, "application/json", "#{JSON.generate(command: command.delete_prefix('/'), sent: true)}\n", COMMANDS.fetch(command)]
          else [404, "text/plain", "unknown: #{method} #{path} (GET /metrics /stats /tasks; POST /phased-restart " \
                                    "/restart /stop /halt /gc /refork)\n"]
          end
        end

        # {Cluster#stats}, each worker with its last metrics (its own, since
        # it started), and `totals`: the counters of every worker since the
        # master started, across restarts ({Counters#totals}).
        def stats
          metrics = @cluster.children.to_h { |worker| [worker.pid, worker.metrics] }
          stats = @cluster.stats
          stats[:workers].each { |worker| worker[:metrics] = metrics[worker[:pid]] }
          stats[:totals] = @cluster.counters.totals
          stats
        end

        # Asks every worker for its task dump and waits (TASKS_TIMEOUT at
        # most) for their answers; a worker that does not answer (its loop
        # held) is listed with `tasks: nil`.
        def tasks
          asked = Clock.now
          workers = @cluster.children.select(&:ready)
          each_worker_command("tasks", workers)
          deadline = asked + TASKS_TIMEOUT
          sleep 0.02 until workers.all? { |worker| worker.tasks_at.to_f > asked } || Clock.now > deadline
          { workers: workers.map { |w| { index: w.index, pid: w.pid, tasks: w.tasks_at.to_f > asked ? w.tasks : nil } } }
        end

        def each_worker_command(command, workers = @cluster.children)
          workers.each { |worker| worker.command(command) } # false: it exited meanwhile
        end

        # @return [String, nil] why the request is refused (401), or nil.
        def unauthorized(head, uri)
          return nil unless @token

          given = head[/^authorization:\s*bearer\s+(\S+)\r?$/i, 1] || URI.decode_www_form(uri.query.to_s).to_h["token"]
          return "a token is needed (Authorization: Bearer TOKEN)\n" unless given
          return nil if given.bytesize == @token.bytesize && OpenSSL.fixed_length_secure_compare(given, @token)

          "wrong token: not the control token this server was started with (--control-token, or the one it logged)\n"
        rescue ArgumentError
          "a token is needed (Authorization: Bearer TOKEN)\n"
        end

        def read_head(client)
          head = +""
          deadline = Clock.now + READ_TIMEOUT
          until head.include?("\r\n\r\n") || head.include?("\n\n")
            return nil if head.bytesize > MAX_HEAD

            chunk = client.read_nonblock(4096, exception: false)
            case chunk
            when :wait_readable
              remaining = deadline - Clock.now
              return nil unless remaining.positive? && client.wait_readable(remaining)
            when nil then return nil
            else head << chunk
            end
          end
          head
        end

        def respond(client, status, body, type = "text/plain")
          reason = { 200 => "OK", 400 => "Bad Request", 401 => "Unauthorized", 404 => "Not Found" }.fetch(status)
          client.write("HTTP/1.0 #{status} #{reason}\r\ncontent-type: #{type}\r\ncontent-length: #{body.bytesize}\r\n" \
                       "connection: close\r\n\r\n#{body}")
        rescue IOError, SystemCallError
          nil
        end
      end
    end
  end
end
