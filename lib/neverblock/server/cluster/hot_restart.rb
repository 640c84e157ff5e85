# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # `HUP`: the master executes its command again (same pid, so systemd
      # and a pidfile keep pointing at it), and a new Ruby, new gems or a
      # `--preload`ed app's new code take over without a refused connection:
      #
      # - the listening sockets stay open across the exec (passed in
      #   NEVERBLOCK_LISTEN_FDS, taken up as systemd's are, {Systemd.claim}),
      #   so connections queue in the kernel meanwhile;
      # - the old workers go on serving while the new image boots its own:
      #   they watch the old master's end of their "alive" pipe, which is
      #   passed on too (NEVERBLOCK_OLD_WORKERS_ALIVE_FD), and the new master
      #   closes it, and sends them TERM, once its own workers accept; being
      #   children of the same pid, they are reaped by it;
      # - supervised commands ({Sidecars}) are stopped before the exec and
      #   started again by the new image.
      #
      # Only `neverblock serve` knows its command line ({Server#restart_command}).
      # A new image whose workers cannot boot keeps the old workers serving
      # (Cluster#keep_predecessors) until the next HUP hands them on again;
      # one whose `--preload`ed app cannot load stops, and the old workers
      # with it: try the new code first, or use USR2.
      module HotRestart
        WORKERS = "NEVERBLOCK_OLD_WORKERS"
        ALIVE_FD = "NEVERBLOCK_OLD_WORKERS_ALIVE_FD"
        LISTEN_FDS = "NEVERBLOCK_LISTEN_FDS"

        # The old image's workers, handed to this one: taken out of ENV.
        Predecessors = Struct.new(:pids, :alive)

        # @return [Predecessors, nil]
        def self.take
          pids = ENV.delete(WORKERS)
          fd = ENV.delete(ALIVE_FD)
          return nil unless pids && fd

          Predecessors.new(pids.split(",").map { |pid| Integer(pid) }, IO.for_fd(Integer(fd), autoclose: true))
        rescue ArgumentError, SystemCallError
          nil
        end

        # Executes `command` in `dir` with the sockets and the old workers
        # passed on. Returns only if the exec failed (logged).
        # @param listeners [Array<Listener>]
        # @param workers [Array<Integer>] the old workers' pids.
        # @param alive [IO] the master's end of their alive pipe.
        # @return [void]
        def self.exec(command, dir, listeners, workers, alive)
          kept = listeners.map(&:io) + [alive]
          kept.each { |io| io.close_on_exec = false }
          env = { LISTEN_FDS => listeners.map { |listener| listener.io.fileno }.join(","),
                  WORKERS => workers.join(","), ALIVE_FD => alive.fileno.to_s }
          $stdout.flush
          $stderr.flush
          options = kept.to_h { |io| [io, io] }.merge(chdir: dir)
          Kernel.exec(env, *command, options)
        rescue SystemCallError => e
          kept&.each { |io| io.close_on_exec = true }
          NeverBlock.logger.error { "NeverBlock::Server: hot restart failed: could not execute #{command.join(' ')}: #{e.message}" }
        end
      end
    end
  end
end
