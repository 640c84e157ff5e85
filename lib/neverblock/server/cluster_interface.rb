# frozen_string_literal: true

module NeverBlock
  class Server
    # The part of a {Server} that its {Cluster} (the master) and each
    # {Cluster::Worker} use, included in it; all of it @api private. The
    # master reads the hooks, the supervision settings and the restart
    # command, and opens the listeners ({Server#listen_all}) before it forks;
    # a worker, before {Server#serve_here}, takes its own wake pipe, its
    # index, the master's {Handoff} and the tasks to run while it serves; a
    # worker promoted to mold keeps its listeners, and each worker forked
    # from it renews the Server ({Cluster::Mold}). None of it is called
    # while a request is answered.
    module ClusterInterface
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
      # Runs the block in a task of its own while serving: from when the
      # acceptors start until the server stops, when the task is cancelled (a
      # worker's heartbeat and command reader, {Cluster::Worker}). Call before
      # {Server#serve_here}.
      # @return [void]
      def while_serving(&block)
        @serving_jobs << block
      end

      # @api private
      # The command line a master executes again on HUP (a hot restart, see
      # {Cluster::HotRestart}), and the directory to run it in; set by
      # `neverblock serve`, nil otherwise (HUP is then refused with a warning).
      # @return [Array(Array<String>, String), nil]
      attr_accessor :restart_command

      # @api private
      # @return [Boolean] {Server#stop} was called (the loop may not have
      #   acted on it yet: see {Server#stopping?}).
      def stop_requested?
        @stop_requested
      end

      # @api private
      # @return [Cluster::Settings] how a master supervises its workers.
      attr_reader :supervision

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
      # Makes a Server that served and stopped (a worker promoted to mold,
      # {Cluster::Mold}) ready to serve again, in a process forked from it:
      # a new wake pipe and a fresh request path (admission, acceptor,
      # connection context), as {Server#initialize} built them; the app, the
      # listeners and the hooks are the ones it served with.
      # @return [void]
      def renew
        own_wake_pipe
        assemble
      end

      # @api private
      # A worker that becomes a mold keeps its listening sockets open when it
      # stops serving: the workers forked from it serve them.
      attr_writer :keep_listeners

      # @api private
      # @return [Boolean] this worker was promoted to mold ({Cluster::Mold}).
      attr_accessor :molding

      # @api private
      # Gives a forked worker a wake pipe of its own. The one made in
      # Server#initialize is inherited by every worker: one worker's {Server#stop}
      # would leave its byte there for all of them, and each one's loop in
      # {Server#serve_here} would find the pipe readable forever (a busy loop).
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

      private

      # With a {Handoff} from the master (a worker beside others): joins it,
      # publishing the connections its {Acceptor} counts as active.
      # @return [Handoff, nil] the handoff joined.
      def joined_handoff
        return nil unless @handoff && @worker_index &&
                          @handoff.attach(@worker_index, @listeners, @acceptor.method(:active_connections))

        @handoff
      end
    end
  end
end
