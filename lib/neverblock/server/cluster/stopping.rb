# frozen_string_literal: true

module NeverBlock
  class Server
    class Cluster
      # How the master stops (included in {Cluster}): TERM and INT
      # ({#begin_stop}), `neverblock ctl halt` ({#halt}), and the wait for
      # every worker, mold and sidecar to exit, killing those still there
      # `KILL_GRACE` seconds after `shutdown_timeout` ({#stop_all}); then
      # the master's last line ({#say_stopped}).
      module Stopping
        private

        # The master's last line, once every worker, mold and sidecar has
        # exited: an operator (or a script tailing the log) knows the stop
        # is over, and whether it had to kill.
        def say_stopped
          killed = @killed_at_stop.to_i
          NeverBlock.logger.info do
            "NeverBlock::Server: master stopped #{(Clock.now - @stop_began).round(1)} s after it was asked to: " \
              "#{killed.zero? ? 'every worker exited' : "#{killed} process(es) killed for not exiting in time"}"
          end
        end

        def begin_stop
          return if @stopping

          @stopping = true
          @stop_began = Clock.now
          @stop_deadline = Clock.now + @server.limits.shutdown_timeout + KILL_GRACE
          @systemd.stopping("stopping #{Server.workers_phrase(@count)}")
          @workers.each_value { |worker| worker.terminate(last: true) }
          @molds.each(&:terminate)
          # The kernel refuses new connections once the workers close their
          # copies too (each takes in what was queued first); a client that
          # connects meanwhile is not queued, to be reset after the drain.
          @listeners.each(&:close)
          @sidecars.stop
        end

        # `neverblock ctl halt`: every worker and sidecar is killed now.
        def halt
          begin_stop
          @stop_deadline = Clock.now
        end

        # Stops every worker and waits for them (killing those still there
        # after the deadline); for when {#supervise} did not get to the end.
        def stop_all
          return if @workers.empty? && @molds.empty? && !@sidecars.running?

          begin_stop unless @stopping
          until @workers.empty? && @molds.empty? && !@sidecars.running?
            if Clock.now > @stop_deadline
              kill_stragglers
              break
            end
            IO.select([@wake_reader], nil, nil, 0.1) unless @wake_reader.closed?
            reap
          end
        end

        def kill_stragglers
          @killed_at_stop = @killed_at_stop.to_i + @workers.size + @molds.size
          (@workers.values + @molds).each(&:kill)
          (@workers.keys + @molds.map(&:pid)).each { |pid| wait_quietly(pid) }
          @workers.clear
          @molds.each(&:close).clear
          @sidecars.kill
          while @sidecars.running?
            break unless wait_any
          end
        end

        # Waits for any child; false when none is left.
        def wait_any
          pid, status = Process.wait2(-1)
          @sidecars.reaped(pid, status, stopping: true)
          true
        rescue Errno::ECHILD
          false
        end

        def wait_quietly(pid)
          Process.wait(pid)
        rescue Errno::ECHILD
          nil
        end
      end
    end
  end
end
