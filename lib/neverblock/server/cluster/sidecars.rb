# frozen_string_literal: true

require "shellwords"

module NeverBlock
  class Server
    class Cluster
      # Commands the master runs beside its workers and keeps running: Solid
      # Queue's supervisor (`bin/jobs`, what Puma's `plugin :solid_queue`
      # runs when SOLID_QUEUE_IN_PUMA is set), or any other sidecar
      # (`supervise "bin/jobs"` in a `-C` file, `supervise:` in
      # {Server#initialize}). {Cluster} starts them once its workers are
      # forked, tells them apart from workers when it reaps children
      # ({#reaped}), restarts one that exits (at once, then after a delay
      # that doubles while it keeps dying within {STABLE} seconds, up to
      # {MAX_DELAY}), and stops them with TERM when it stops ({#stop}). A
      # rolling restart of the workers leaves them alone.
      #
      # Each is its own process (`Process.spawn`, not a fork of the master):
      # it boots the app itself, as `bin/jobs` does from a shell, and its
      # output goes where the master's does. Each leads a process group of
      # its own, and every signal goes to the whole group: what it forked
      # (Solid Queue's scheduler, dispatcher and workers) stops with it, and
      # when the sidecar itself dies (a `kill -9`, the OOM killer) what it
      # left running is sent TERM, not left orphaned under pid 1.
      class Sidecars
        # A sidecar that ran this long (seconds) before it exited is
        # restarted at once; one that died sooner waits a delay that doubles.
        STABLE = 10
        # The longest delay (seconds) before a dying sidecar is restarted.
        MAX_DELAY = 30

        # One supervised command.
        Sidecar = Struct.new(:command, :pid, :started_at, :restarts, :delay, :due_at, keyword_init: true)

        # @param commands [Array<String, Array<String>>] a shell-free command
        #   line (split like a shell would, without running one) or an argv.
        # @param chdir [String] where they run (the app's directory).
        # @raise [ArgumentError] for an empty command.
        def initialize(commands, chdir: Dir.pwd)
          @chdir = chdir
          @env = {}
          @sidecars = commands.map do |command|
            argv = command.is_a?(Array) ? command.map(&:to_s) : Shellwords.split(command.to_s)
            raise ArgumentError, "supervise needs a command, got #{command.inspect}" if argv.empty?

            Sidecar.new(command: argv, restarts: 0, delay: 0.0, due_at: 0.0)
          end
        end

        # @param env [Hash{String => String}] variables the commands started
        #   from now on get, besides the master's own ({JobMetrics#env}).
        attr_writer :env

        # @return [Boolean] whether there is nothing to supervise.
        def empty?
          @sidecars.empty?
        end

        # Starts every sidecar that is not running and is due (all of them,
        # the first time). Called on each turn of the master's loop.
        # @return [void]
        def start_due
          now = Clock.now
          @sidecars.each { |sidecar| spawn(sidecar) if sidecar.pid.nil? && now >= sidecar.due_at }
        end

        # @return [Float, nil] seconds until a restart is due, for the
        #   master's wait; nil when none is waiting.
        def next_due_in
          waiting = @sidecars.reject(&:pid)
          return nil if waiting.empty?

          [waiting.map(&:due_at).min - Clock.now, 0.0].max
        end

        # The master reaped `pid`: if it was a sidecar, note that it exited
        # (it is restarted by {#start_due}, unless stopping).
        # @return [Boolean] whether `pid` was a sidecar.
        def reaped(pid, status, stopping:)
          sidecar = @sidecars.find { |candidate| candidate.pid == pid } or return false

          sidecar.pid = nil
          Cluster.signal(-pid, "TERM") # what it left behind in its group
          return true if stopping

          ran = Clock.now - sidecar.started_at
          sidecar.delay = ran >= STABLE ? 0.0 : [[sidecar.delay * 2, 0.5].max, MAX_DELAY].min
          sidecar.due_at = Clock.now + sidecar.delay
          sidecar.restarts += 1
          NeverBlock.logger.warn do
            "NeverBlock::Server: supervised `#{sidecar.command.join(' ')}` (pid #{pid}) exited " \
              "(#{status.signaled? ? "signal #{Signal.signame(status.termsig)}" : "exit #{status.exitstatus}"}) " \
              "after #{ran.round(1)} s; restarting it#{sidecar.delay.positive? ? " in #{sidecar.delay} s" : ''}"
          end
          true
        end

        # Sends TERM to every running sidecar (the master is stopping).
        # @return [void]
        def stop
          signal_all("TERM")
        end

        # Sends KILL to those still running (past the stop deadline).
        # @return [void]
        def kill
          signal_all("KILL")
        end

        # @return [Boolean] whether one still runs.
        def running?
          @sidecars.any?(&:pid)
        end

        # @return [Array<Hash>] `[{command:, pid:, restarts:}]`.
        def stats
          @sidecars.map { |sidecar| { command: sidecar.command.join(" "), pid: sidecar.pid, restarts: sidecar.restarts } }
        end

        private

        def spawn(sidecar)
          sidecar.pid = Process.spawn(@env, *sidecar.command, chdir: @chdir, pgroup: true)
          sidecar.started_at = Clock.now
          NeverBlock.logger.info { "NeverBlock::Server: supervising `#{sidecar.command.join(' ')}` (pid #{sidecar.pid})" }
        rescue SystemCallError => e
          sidecar.pid = nil
          sidecar.delay = [[sidecar.delay * 2, 0.5].max, MAX_DELAY].min
          sidecar.due_at = Clock.now + sidecar.delay
          NeverBlock.logger.error do
            "NeverBlock::Server: could not start `#{sidecar.command.join(' ')}` in #{@chdir}: #{e.message}; " \
              "trying again in #{sidecar.delay} s"
          end
        end

        def signal_all(name)
          @sidecars.each { |sidecar| Cluster.signal(-sidecar.pid, name) if sidecar.pid }
        end
      end
    end
  end
end
