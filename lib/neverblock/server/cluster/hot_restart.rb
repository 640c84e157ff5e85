# frozen_string_literal: true

require "json"
require "tempfile"

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
      # ({Master#keep_predecessors}) until the next HUP hands them on again;
      # one whose `--preload`ed app cannot load stops, and the old workers
      # with it: try the new code first, or use USR2.
      module HotRestart
        WORKERS = "NEVERBLOCK_OLD_WORKERS"
        # An unlinked file holding the old image's {Cluster#carried} state
        # (JSON; with the counters of many workers it may outgrow a pipe's
        # buffer, and nothing reads a pipe until the new image runs).
        STATE_FD = "NEVERBLOCK_MASTER_STATE_FD"
        ALIVE_FD = "NEVERBLOCK_OLD_WORKERS_ALIVE_FD"
        LISTEN_FDS = "NEVERBLOCK_LISTEN_FDS"

        # The old image's workers, handed to this one: taken out of ENV.
        Predecessors = Struct.new(:pids, :alive)

        # @return [Predecessors, nil]
        def self.take
          pids = ENV.delete(WORKERS)
          fd = ENV.delete(ALIVE_FD)
          return nil unless pids && fd

          alive = IO.for_fd(Integer(fd), autoclose: true)
          alive.close_on_exec = true # not into this image's sidecars (the next HUP clears it again)
          Predecessors.new(pids.split(",").map { |pid| Integer(pid) }, alive)
        rescue ArgumentError, SystemCallError
          nil
        end

        # What the old image carried over ({Cluster#carried}): the control
        # token, the restart counts, the workers' counters. Taken out of ENV;
        # empty on a first start.
        # @return [Hash{String => Object}]
        def self.take_state
          fd = ENV.delete(STATE_FD) or return {}
          io = IO.for_fd(Integer(fd), autoclose: true)
          state = JSON.parse(io.read)
          state.is_a?(Hash) ? state : {}
        rescue ArgumentError, SystemCallError, IOError, JSON::ParserError
          {}
        ensure
          io&.close
        end

        # Executes `command` in `dir` with the sockets, the old workers and
        # `state` passed on. Returns only if the exec failed (logged).
        # @param listeners [Array<Listener>]
        # @param workers [Array<Integer>] the old workers' pids.
        # @param alive [IO] the master's end of their alive pipe.
        # @param state [Hash] JSON-able, for {.take_state} in the new image.
        # @return [void]
        def self.exec(command, dir, listeners, workers, alive, state = {})
          state_reader = state_file(JSON.generate(state))
          kept = listeners.map(&:io) + [alive, state_reader]
          kept.each { |io| io.close_on_exec = false }
          env = { LISTEN_FDS => listeners.map { |listener| listener.io.fileno }.join(","),
                  WORKERS => workers.join(","), ALIVE_FD => alive.fileno.to_s, STATE_FD => state_reader.fileno.to_s }
          $stdout.flush
          $stderr.flush
          options = kept.to_h { |io| [io, io] }.merge(chdir: dir)
          Kernel.exec(env, *command, options)
        rescue SystemCallError => e
          kept&.each { |io| io.close_on_exec = true }
          state_reader&.close
          NeverBlock.logger.error { "NeverBlock::Server: hot restart failed: could not execute #{command.join(' ')}: #{e.message}" }
        end

        # @return [File] an unlinked temporary file holding `text`, read from its start.
        def self.state_file(text)
          file = Tempfile.create("neverblock-state")
          File.unlink(file.path)
          file.write(text)
          file.rewind
          file
        end
        private_class_method :state_file

        # The master's side of a hot restart, included in {Cluster}: HUP,
        # and what happens to the old image's workers once this image's
        # workers accept or cannot boot.
        module Master
          private

          # What a hot restart hands the next image ({HotRestart.take_state}):
          # the control token (one made at start too, so that Prometheus and
          # `neverblock ctl` keep theirs) and the counts /stats and /metrics
          # show, the workers' counters among them ({Counters}).
          # @return [Hash]
          def carried
            { "control_token" => @control&.token || @control_token, "generation" => @generation,
              "restarts" => @restarts, "hot_restarts" => @hot_restarts + 1, "reforks" => reforks,
              "counters" => @counters.carried }
          end

          def carry_over(state)
            @control_token ||= state["control_token"] if state["control_token"].is_a?(String)
            @generation = state["generation"] if state["generation"].is_a?(Integer)
            @hot_restarts = state["hot_restarts"] if state["hot_restarts"].is_a?(Integer)
            @reforks = state["reforks"] if state["reforks"].is_a?(Integer)
            @counters = Counters.new(state["counters"]) if state["counters"]
            (state["restarts"].is_a?(Hash) ? state["restarts"] : {}).each do |cause, count|
              @restarts[cause.to_sym] = count if count.is_a?(Integer) && restarts.key?(cause.to_sym)
            end
          end

          # HUP: the master executes its command again (see {HotRestart}), once
          # its sidecars stopped. Returns only when that could not be done.
          # `heard`: how the master was asked, for the log ("got HUP").
          def hot_restart(heard)
            return if @stopping

            command, dir = @server.restart_command
            unless command
              NeverBlock.logger.warn("NeverBlock::Server: HUP (hot restart) needs the command line of `neverblock serve`; ignored")
              return
            end
            NeverBlock.logger.info { "NeverBlock::Server: master #{heard}: #{SIGNAL_ACTIONS.fetch('HUP')} (#{command.join(' ')})" }
            @server.call_hook(:on_restart)
            @systemd.reloading("hot restart")
            @sidecars.stop
            deadline = Clock.now + @server.limits.shutdown_timeout
            while @sidecars.running? && Clock.now < deadline
              IO.select([@wake_reader], nil, nil, 0.1)
              reap
            end
            @sidecars.kill
            @job_metrics&.close # the next image makes its own (the exec skips #run's ensure)
            @molds.each(&:terminate) # the next image forks its workers from its own master
            if @boot_paused # this image never served: the previous image's workers are handed on again
              HotRestart.exec(command, dir, @listeners, @predecessors.pids, @predecessors.alive, carried)
            else
              HotRestart.exec(command, dir, @listeners, @workers.keys, @alive_writer, carried)
            end
          end

          # After a hot restart, once this image's workers accept: the old
          # image's workers stop (TERM). Their alive pipe stays open until
          # they have all exited ({#predecessor_exited}): to a worker, EOF on
          # it before it was told to stop means its master is gone.
          def retire_predecessors
            old = @predecessors or return
            @predecessors = nil
            stopping = old.pids.select { |pid| Cluster.signal(pid, "TERM") } # (one reaped already is not waited for)
            @departing = Predecessors.new(stopping, old.alive)
            release_departed
            NeverBlock.logger.info { "NeverBlock::Server: hot restart done; the old workers (#{old.pids.join(', ')}) stop" }
          end

          # A process the master waited for that was not one of its workers:
          # one of the old image's, retired, closes their alive pipe when it
          # is the last.
          # @return [Boolean] whether it was one of them.
          def predecessor_exited(pid)
            return false unless @departing&.pids&.delete(pid)

            release_departed
            true
          end

          # Closes the old workers' alive pipe once none of them is left.
          def release_departed
            return unless @departing&.pids&.empty?

            @departing.alive.close
            @departing = nil
          end

          # A hot restart into an app that does not boot: the old image's workers
          # keep serving, this image boots no more workers (its app is broken)
          # until the next HUP, which hands those same workers on again. If they
          # are all gone meanwhile, booting resumes, and so does giving up.
          def keep_predecessors
            NeverBlock.logger.error do
              "NeverBlock::Server: hot restart abandoned: the new workers exited #{@boot_failures} times in a row before " \
                "their app booted#{@last_boot_failure ? " (#{@last_boot_failure})" : ''}; the previous workers " \
                "(#{@predecessors.pids.join(', ')}) keep serving the previous code: fix the app and send HUP again"
            end
            @boot_failures = 0
            @boot_paused = true
            @systemd.ready("hot restart abandoned; the previous workers serve")
          end

          def predecessors_alive?
            @predecessors.pids.any? { |pid| Cluster.signal(pid, 0) }
          end
        end
      end
    end
  end
end
