# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # What runs in a forked worker process: {Cluster}'s `spawn_worker`
      # calls {.run} in the child right after `fork`, and it never returns
      # (the process exits). It turns the forked copy of the master's
      # {Server} into one that serves: its own wake pipe and signal
      # handlers, the `on_worker_boot` hook, a thread that stops it when the
      # master dies, then {Server#serve_here}. It tells the master how far
      # it got ("booted", "ready", "boot-failed ...") on its status pipe,
      # then, while serving, "beat REQUESTS" from a task of its loop every
      # {Settings#heartbeat_interval} (a loop held by one fiber sends none:
      # the master's watchdog), and "dumped" once it logged its tasks on
      # QUIT (the watchdog's last question before it kills). Once its loop
      # has ended, it reports its counts a last time, so that the master's
      # {Counters} miss none of its last requests.
      class Worker
        # @api private
        # Serves until told to stop (TERM/INT, or the master's pipe closing),
        # then exits the process: 0 after a clean stop, 1 if the app failed
        # to boot or serving raised.
        # @return [void] never returns.
        # A boot failure is logged with its backtrace when `explain_failure`
        # (the first worker of a boot round), else in one line: the master
        # retries, and every retry usually fails the same way.
        def self.run(server, index, status_writer, alive_reader, master_only, cluster, commands: nil, explain_failure: true)
          server.cluster = nil # this process serves; Server#stop stops it
          server.own_wake_pipe
          trap("TERM") { server.stop }
          trap("INT") { server.stop(last: true) } # the master stops (Cluster#begin_stop), or Ctrl-C
          # TERM or INT came between fork and the traps above (INT: the last stop).
          server.stop(last: cluster.stop_before_trap? == "INT") if cluster.stop_before_trap?
          (SIGNALS - %w[TERM INT QUIT]).each { |name| trap(name, "DEFAULT") }
          trap("QUIT") { server.log_task_dump(-> { report(status_writer, "dumped") }) }
          # Meant for the master; a signal sent to the whole process group must not end a worker.
          %w[USR2 HUP TTIN TTOU URG].each { |name| trap(name, "IGNORE") }
          master_only.each { |io| io.close unless io.closed? }
          server.worker_index = index
          server.handoff = cluster.handoff
          server.access_log&.worker = index
          Process.setproctitle("neverblock worker #{index} (master #{cluster.master_pid})")
          status = 1
          booted = false
          begin
            server.hooks[:on_worker_boot]&.call(index)
            booted = true
            report(status_writer, "booted")
            watch_master(server, alive_reader, index, cluster.master_pid)
            server.on_ready = -> { report(status_writer, "ready") }
            server.metrics = Metrics.new if server.supervision.control
            server.while_serving { heartbeat(server, status_writer, server.supervision.heartbeat_interval) }
            server.while_serving { read_commands(server, status_writer, commands) } if commands
            if (warm = server.supervision.refork_when)
              server.while_serving { watch_warmth(status_writer, index, warm, server.supervision.heartbeat_interval) }
            end
            server.serve_here
            report(status_writer, counts(server)) # what it counted since its last heartbeat (Counters)
            Mold.new(server, index, status_writer, commands, alive_reader, cluster).run if server.molding
            server.call_hook(:before_worker_shutdown, index)
            status = 0
          rescue Exception => e # rubocop:disable Lint/RescueException -- a worker reports every death
            if booted
              log_failure(index, "failed", e, backtrace: true)
            else
              report(status_writer, "boot-failed #{summary(e)}")
              log_failure(index, "could not boot the app", e, backtrace: explain_failure)
            end
          ensure
            status_writer.close unless status_writer.closed?
            $stdout.flush
            $stderr.flush
            exit!(status)
          end
        end

        def self.log_failure(index, what, error, backtrace:)
          NeverBlock.logger.error do
            detail = backtrace ? "#{error.class}: #{error.message}\n#{(error.backtrace || []).join("\n")}" : summary(error)
            "NeverBlock::Server: worker #{index} (pid #{Process.pid}) #{what}: #{detail}"
          end
        end

        # @return [String] one line: the error, its message's first line, and
        #   where it came from (the first frame outside NeverBlock and Rack).
        def self.summary(error)
          frame = (error.backtrace || []).find { |line| !line.include?("/lib/neverblock/") && !line.include?("/rack") }
          message = error.message.to_s.lines.first.to_s.strip
          "#{error.class}: #{message[0, 500]}#{" (#{frame[/\A[^:]+:\d+/]})" if frame}"
        end

        # Tells the master how far the worker got; a master already gone
        # (the pipe broken) is noticed by {.watch_master}.
        def self.report(status_writer, status)
          status_writer.write("#{status}\n")
        rescue Errno::EPIPE, IOError
          nil
        end

        # The heartbeat task: "beat REQUESTS" (with the metrics when the
        # master serves them) every `seconds`, from a task of the loop, so
        # that it stops when the loop stops turning (a loop held by one fiber
        # sends none: that is what the master's watchdog watches for). A
        # full pipe makes this task wait, not the loop.
        def self.heartbeat(server, status_writer, seconds)
          loop do
            status_writer.write("#{counts(server)}\n")
            NeverBlock.sleep(seconds)
          end
        rescue Errno::EPIPE, IOError
          nil # the master is gone: .watch_master stops the server
        end

        # @return [String] "beat REQUESTS", and "metrics JSON" on a line of
        #   its own when the master serves them (no newline at the end).
        def self.counts(server)
          snapshot = server.metrics_snapshot
          "beat #{server.requests_total}#{"\nmetrics #{JSON.generate(snapshot)}" if snapshot}"
        end

        # The `refork_when` task: asks the app's callable whether this worker
        # is warm every `seconds` until it says so, then reports "warm" once
        # ({Refork} promotes only a warm worker). One that raises counts as
        # not warm, and is logged once.
        def self.watch_warmth(status_writer, index, warm, seconds)
          complained = false
          loop do
            begin
              return report(status_writer, "warm") if warm.call(index)
            rescue StandardError => e
              unless complained
                complained = true
                NeverBlock.logger.error do
                  "NeverBlock::Server: worker #{index} (pid #{Process.pid}): refork_when raised #{e.class}: #{e.message}; " \
                    "it counts as not warm"
                end
              end
            end
            NeverBlock.sleep(seconds)
          end
        end

        # The command reader's task: each line from the master's command
        # pipe is a command ({.obey}).
        def self.read_commands(server, status_writer, commands)
          while (line = commands.gets)
            obey(server, status_writer, line.chomp)
          end
        rescue IOError
          nil
        end

        # A command from the master: `gc` runs a full GC; `tasks` answers
        # with {Server#task_dump} on the status pipe (both from the control
        # listener); `mold` promotes this worker ({Mold.promote}).
        def self.obey(server, status_writer, command)
          case command
          when "gc" then GC.start
          when "tasks" then report(status_writer, "tasks #{JSON.generate(server.task_dump)}")
          when "mold" then Mold.promote(server)
          end
        end

        # A thread that stops the server when the master's end of the pipe
        # closes (the master died, even by SIGKILL), and says so: a worker
        # that stops with no one having asked would otherwise exit without a
        # word. A master closes it on purpose only once this worker was told
        # to stop (TERM, {HotRestart::Master#retire_predecessors}), and then
        # nothing is said.
        def self.watch_master(server, alive_reader, index, master_pid)
          Thread.new do
            if alive_reader.read(1).nil? && !server.stop_requested?
              NeverBlock.logger.warn do
                "NeverBlock::Server: worker #{index} (pid #{Process.pid}) stops: its master (pid #{master_pid}) is gone " \
                  "(killed?); it finishes its requests first (up to shutdown_timeout)"
              end
            end
          rescue IOError
            nil
          ensure
            server.stop
          end
        end
      end
    end
  end
end
