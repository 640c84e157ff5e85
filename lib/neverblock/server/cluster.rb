# frozen_string_literal: true

module NeverBlock
  class Server
    # The master of a preforked {Server}: it binds the listening sockets once,
    # forks the workers (each inherits the sockets and serves them with its
    # own NeverBlock loop, {Server#serve_here}: see {Worker}, in
    # cluster/worker.rb), respawns a worker that dies and handles signals:
    #
    # - `TERM`, `INT` :: graceful stop: every worker stops accepting, finishes
    #   its requests for up to `shutdown_timeout` and exits; then the master
    #   closes the sockets and {Server#run} returns. A worker still alive
    #   `KILL_GRACE` seconds after that is killed.
    # - `USR2` :: rolling restart: workers are replaced one at a time, each
    #   new worker ready (booted and accepting) before its predecessor is
    #   asked to stop. The listening sockets stay open in the master the
    #   whole time, so no connection is refused.
    # - `TTIN`, `TTOU` :: one worker more, one fewer.
    # - `QUIT` :: every worker logs what its tasks are doing ({TaskDump}).
    # - `URG` :: refork: a warmed-up worker becomes the mold the next
    #   generation is forked from ({Refork}, in cluster/refork.rb).
    #
    # Beside the workers it keeps the `supervise` commands running
    # ({Sidecars}: Solid Queue's `bin/jobs`), and stops them when it stops.
    #
    # It also watches each worker and replaces it when it hangs or grows
    # ({Watchdog}, in cluster/watchdog.rb).
    #
    # A worker that dies is replaced at once, however often: an app whose
    # requests crash their worker never takes the master down. Only a
    # worker that dies before its app finished booting (`on_worker_boot`,
    # which loads the app when it is not preloaded) counts as a boot
    # failure: it is retried with a growing delay, and after
    # {MAX_BOOT_FAILURES} such deaths in a row the master gives up and
    # {Server#run} raises {BootError}.
    #
    # The master runs no NeverBlock loop and no app code (unless the app was
    # loaded before {Server#run}: that is `--preload`, copy-on-write shared).
    # Workers notice a master that died (its pipe closes) and stop.
    class Cluster
      # Seconds after `shutdown_timeout` before a worker that has not exited is killed.
      KILL_GRACE = 5

      # Boot failures in a row after which the master gives up.
      MAX_BOOT_FAILURES = 5

      # Longest delay between boot retries (seconds).
      MAX_BOOT_DELAY = 10


      SIGNALS = %w[TERM INT USR2 HUP TTIN TTOU QUIT URG CHLD].freeze

      # Sends signal `name` (or 0, which only checks) to `pid`.
      # @return [Boolean] false when no such process is left.
      def self.signal(pid, name)
        Process.kill(name, pid)
        true
      rescue Errno::ESRCH, Errno::EPERM # (EPERM: a process group of others')
        false
      end

      # Runs the block with `handlers` (signal name => Proc) trapped, and the
      # previous handlers back afterwards.
      # @return [Object] the block's value.
      def self.trapping(handlers)
        previous = handlers.to_h { |name, handler| [name, trap(name, &handler)] }
        yield
      ensure
        previous&.each { |name, handler| trap(name, handler || "DEFAULT") }
      end

      # What the master logs it does on each signal.
      SIGNAL_ACTIONS = { "TERM" => "stopping gracefully", "INT" => "stopping gracefully",
                         "USR2" => "rolling restart", "HUP" => "hot restart: executing its command again, keeping its sockets",
                         "TTIN" => "one worker more",
                         "TTOU" => "one worker fewer", "QUIT" => "asking every worker for its task dump",
                         "HALT" => "halting: killing every worker now",
                         "URG" => "refork: promoting a warmed-up worker to mold" }.freeze
      private_constant :SIGNALS

      include HotRestart::Master
      include Watchdog
      include Refork
      include Stopping
      include Rollout

      # @param server [Server]
      # @param count [Integer] workers to keep running.
      # @param listeners [Array<Listener>]
      # @param settings [Settings] the watchdog and recycling.
      def initialize(server, count, listeners, settings = Settings.build)
        @server = server
        @count = count
        @listeners = listeners
        @settings = settings
        @retiring = [] # workers to replace gracefully, one at a time
        @restarts = Hash.new(0) # cause => workers replaced for it
        @hot_restarts = 0
        @control_token = settings.control_token # else the old image's, or one Control makes
        @memory_checked_at = 0.0
        @booted = false # every worker accepted once (on_booted was called)
        @sidecars = Sidecars.new(settings.supervise)
        @systemd = Systemd::Notifier.new # quiet unless NOTIFY_SOCKET is set
        @reloading = false # a rolling restart told systemd RELOADING=1
        @control = nil # the Control listener, while running
        @predecessors = nil # HotRestart::Predecessors, until this image's workers accept
        @boot_paused = false # a hot restart's app did not boot: no workers until the next HUP
        @workers = {} # pid => Worker
        @generation = 0
        @signals = Thread::Queue.new
        @boot_failures = 0
        @next_boot_at = 0.0
        @restart_queue = []
        @stopping = false
        @rollout = nil # the rolling restart or refork under way (Rollout)
        @counters = Counters.new # what the workers counted, kept across their restarts
        @handoff = nil
        start_reforking
      end

      # Runs the master until a stop signal (or {Server#stop}) and every
      # worker has exited.
      # @return [void]
      # @raise [Error] inside a running NeverBlock loop (the master blocks).
      # @raise [BootError] when workers keep dying before their app booted.
      def run
        raise Error, "a Server with workers forks and blocks: call #run outside NeverBlock.run, or pass workers: 0" if Fiber.scheduler

        @server.listen_all
        @master_pid = Process.pid
        retitle
        @stop_before_trap = false
        @wake_reader, @wake_writer = IO.pipe
        @alive_reader, @alive_writer = IO.pipe # workers see EOF when the master is gone
        carry_over(HotRestart.take_state)
        Refork.subreaper! if @settings.refork_after.any?
        Cluster.trapping(SIGNALS.to_h { |name| [name, proc { signal(name) }] }) do
          @control = start_control if @settings.control
          @job_metrics = start_job_metrics if @control && !@sidecars.empty?
          @server.cluster = self
          @server.hooks[:before_fork]&.call
          @predecessors = HotRestart.take # the old image's workers, after a hot restart
          @handoff = Handoff.build(@count)
          @count.times { |index| spawn_worker(index) }
          @sidecars.start_due
          supervise
          say_stopped
        ensure
          stop_all
          @control&.stop
          @job_metrics&.close
        end
      ensure
        [@wake_reader, @wake_writer, @alive_reader, @alive_writer].each { |io| io.close if io && !io.closed? }
        @workers.each_value(&:close)
      end

      # Asks the master to stop gracefully (as TERM does). Safe from any
      # thread and from a signal handler.
      # @return [void]
      def stop
        signal("TERM", "by Server#stop")
      end

      # Asks the master for a rolling restart (as USR2 does).
      # @return [void]
      def restart
        signal("USR2", "by Server#restart")
      end

      # @return [Hash] `{master_pid:, workers: [{index:, pid:, generation:, ready:, started_at:, requests:,
      #   retiring:}], requests_total:, generation:, stopping:, restarts: {crash:, watchdog:, boot_timeout:, requests:,
      #   memory:}, hot_restarts:, reforks:, mold:, supervised:}`: `requests` as of the worker's last heartbeat, since it
      #   started; `requests_total` those every worker started, since the master started, across restarts ({Counters});
      #   `restarts` counts workers replaced, by cause; with `requests_total`, `generation`, `hot_restarts` and `reforks`
      #   it carries on across hot restarts; `mold` is the worker new ones fork from ({Refork}; nil: the master).
      def stats
        workers = @workers.values.sort_by(&:index).map(&:to_h)
        { master_pid: Process.pid, workers: workers, requests_total: @counters.requests_started, generation: @generation,
          stopping: @stopping, restarts: restarts, hot_restarts: @hot_restarts, reforks: reforks, mold: @mold&.to_h,
          supervised: @sidecars.stats }
      end

      # @api private
      # What the control listener asks for ({Control}): `"TERM"` (stop),
      # `"USR2"` (rolling restart), `"HUP"` (hot restart), `"URG"` (refork), `"HALT"`. Safe from any thread.
      # The log names the request, not a signal: none was sent.
      # @param request [String] what was asked, like `"POST /phased-restart"`.
      # @return [void]
      def command(name, request)
        signal(name, "over the control listener (#{request})")
      end

      # @api private
      # @return [JobMetrics, nil] the jobs of the supervised commands' Solid
      #   Queue fiber workers, with a control listener (else nil).
      attr_reader :job_metrics

      # @api private
      # @return [Array<Child>] the workers now (one C call: safe to read
      #   from another thread, unlike iterating the Hash).
      def children
        @workers.values
      end

      # @api private
      # @return [Cluster::Settings]
      attr_reader :settings

      # @api private
      # @return [Counters] what the workers counted, for /metrics and /stats.
      attr_reader :counters

      # @api private
      # @return [Integer] the master's pid (a worker forked by a mold has another parent at first).
      attr_reader :master_pid

      # @api private
      # @return [Handoff, nil] made before the first fork (nil when off).
      attr_reader :handoff

      # Whether workers are being replaced or stopped (a rolling restart,
      # recycling, TTOU, a stop): workers move no connections meanwhile
      # ({Handoff#paused=}).
      def replacing?
        @stopping || promoting? || !@restart_queue.empty? || !@retiring.empty? || @workers.each_value.any?(&:stopping)
      end

      # @api private
      # @return [Hash{Symbol => Integer}] workers replaced, by cause.
      def restarts
        %i[crash watchdog boot_timeout requests memory].to_h { |cause| [cause, @restarts[cause]] }
      end

      # @api private
      # @return [String, false] "TERM" or "INT" when this (forked) process got
      #   it before its worker handlers were in place, else false.
      def stop_before_trap?
        @stop_before_trap
      end

      private

      # In a worker that has not yet installed its own handlers (just
      # forked), the master's handler still runs: a stop signal is noted for
      # the worker to act on ({Worker.run}), not sent to the master's pipe.
      # `origin` says who asked when it was not a signal (the log's words).
      def signal(name, origin = nil)
        if Process.pid != @master_pid
          @stop_before_trap = name if %w[TERM INT].include?(name)
          return
        end
        @signals << [name, origin]
        @wake_writer&.write_nonblock(".", exception: false)
      rescue IOError
        nil
      end

      # The master's loop: waits for a signal, a worker's readiness or
      # death, or the next boot retry, and acts on it.
      def supervise
        until @stopping && @workers.empty? && @molds.empty? && !@sidecars.running?
          wait_for_events
          reap
          handle_signals
          give_up_booting if @boot_failures >= MAX_BOOT_FAILURES
          @handoff&.paused = replacing?
          if @stopping
            kill_stragglers if Clock.now > @stop_deadline
            next
          end

          watch_workers
          @systemd.watchdog
          @sidecars.start_due
          replace_missing
          continue_restart
          continue_retiring
          continue_refork
          notice_rollout_done
          notice_booted
        end
      end

      def wait_for_events
        readers = [@wake_reader] + @workers.each_value.map(&:status_reader).reject(&:closed?)
        ready, = IO.select(readers, nil, nil, select_timeout)
        ready&.each do |io|
          if io == @wake_reader
            io.read_nonblock(1024, exception: false)
          elsif (worker = @workers.each_value.find { |w| w.status_reader.equal?(io) })
            worker.read_status { |note| noted(worker, note) }
          else
            io.close
          end
        end
      end

      # Signals and worker deaths wake the master through pipes; the timeout
      # is for a boot retry that is due (a delay after a boot failure) and
      # a once-a-second look around otherwise, not a poll.
      def select_timeout
        return 0.5 if @stopping

        longest = [@settings.heartbeat_interval, Watchdog::DUMP_GRACE.to_f, @sidecars.next_due_in, @systemd.watchdog_due_in].compact.min
        wait = @next_boot_at - Clock.now
        wait.positive? ? wait.clamp(0.05, longest) : longest
      end

      # Acts on what a worker reported ({Child#read_status}).
      def noted(worker, note)
        case note
        when :booted then @boot_failures = 0
        when :dumped then worker.kill_hung
        when :max_requests then retire(worker, :requests)
        when :molded then molded(worker)
        when :mold_refused then mold_refused(worker)
        end
      end

      def reap
        loop do
          pid, status = Process.wait2(-1, Process::WNOHANG)
          break unless pid

          worker = @workers.delete(pid)
          next if mold_exited(pid, status)

          @sidecars.reaped(pid, status, stopping: @stopping) unless worker || predecessor_exited(pid)
          next unless worker

          worker.drain_status { |note| noted(worker, note) if note == :booted } # (a dead worker is not dumped or retired)
          @counters.forget(pid) # (after its last report, just read)
          @handoff&.vacate(worker.index, worker.pid)
          worker_exited(worker, status)
          @server.call_hook(:after_worker_exit, worker.index, status)
        end
      rescue Errno::ECHILD
        nil
      end

      # A worker that exited without being asked to. Killed by the watchdog,
      # or dead after its app booted: replaced at once. Dead before that
      # (also killed for `worker_boot_timeout`): a boot failure, retried after
      # a growing delay.
      def worker_exited(worker, status)
        return if worker.stopping

        if worker.hung_at
          @restarts[worker.ready ? :watchdog : :boot_timeout] += 1
          NeverBlock.logger.warn { "NeverBlock::Server: #{worker} killed by the watchdog" }
        elsif worker.booted
          @restarts[:crash] += 1
          NeverBlock.logger.warn { "NeverBlock::Server: #{worker} died (#{describe(status)}); starting a new one" }
        end
        return if worker.booted

        @boot_failures += 1
        @last_boot_failure = worker.failure if worker.failure
        delay = [0.2 * (2**(@boot_failures - 1)), MAX_BOOT_DELAY].min
        @next_boot_at = Clock.now + delay
        NeverBlock.logger.error do
          "NeverBlock::Server: #{worker} exited before its app booted (#{describe(status)}); " \
            "#{@boot_failures} boot failure(s) in a row#{", retrying in #{delay} s" if @boot_failures < MAX_BOOT_FAILURES}"
        end
      end

      def describe(status)
        status.signaled? ? "signal #{Signal.signame(status.termsig)}" : "exit #{status.exitstatus}"
      end

      def handle_signals
        until @signals.empty?
          name, origin = @signals.pop
          heard = origin ? "asked #{origin}" : "got #{name}"
          case name
          when "TERM", "INT" then begin_stop
          when "USR2" then begin_restart
          when "HUP" then hot_restart(heard)
          when "TTIN" then @count += 1
          when "TTOU" then @count = [@count - 1, 1].max
          when "QUIT" then @workers.each_value { |worker| worker.signal("QUIT") }
          when "URG" then refork_requested
          when "HALT" then halt
          else next
          end
          NeverBlock.logger.info { "NeverBlock::Server: master #{heard}: #{SIGNAL_ACTIONS.fetch(name)} (#{Server.workers_phrase(@count)})" }
          retitle if %w[TTIN TTOU].include?(name)
        end
        retire_surplus unless @stopping
      end

      # The master's process title, with the worker count it keeps now.
      def retitle
        Process.setproctitle("neverblock master (#{Server.workers_phrase(@count)}) #{@listeners.map(&:address).join(' ')}")
      end

      def start_control
        require_relative "cluster/control"
        require_relative "cluster/prometheus"
        Control.new(self, @settings.control, @control_token).start
      end

      # The supervised commands get the directory their Solid Queue fiber
      # workers write their job counts to, for /metrics.
      def start_job_metrics
        require_relative "cluster/job_metrics"
        JobMetrics.new.tap { |metrics| @sidecars.env = metrics.env }
      end

      def begin_restart
        return if @stopping

        @server.call_hook(:on_restart)
        drop_mold # the new workers load the app anew, from the master
        @systemd.reloading("rolling restart of #{Server.workers_phrase(@count)}")
        @reloading = true
        @generation += 1
        begin_rollout("rolling restart")
        @restart_queue = (0...@count).to_a
      end

      # Rolling restart, one index at a time: start the new worker, wait
      # until it is ready, then stop the old one.
      def continue_restart
        index = @restart_queue.first or return
        current = @workers.each_value.select { |worker| worker.index == index && !worker.stopping }
        fresh = current.find { |worker| worker.generation == @generation }
        if fresh.nil?
          spawn_worker(index) if Clock.now >= @next_boot_at
        elsif fresh.ready
          current.each { |worker| worker.terminate unless worker.equal?(fresh) }
          @restart_queue.shift
        end
      end

      def replace_missing
        return if Clock.now < @next_boot_at
        return if @boot_paused && (@boot_paused = predecessors_alive?) # the previous workers serve (keep_predecessors)

        (0...@count).each do |index|
          next if @restart_queue.first == index # the restart starts that one itself
          next if @workers.each_value.any? { |worker| worker.index == index && !worker.stopping }

          spawn_worker(index)
        end
      end

      def retire_surplus
        @workers.each_value do |worker|
          worker.terminate if worker.index >= @count && !worker.stopping
        end
        @restart_queue.reject! { |index| index >= @count }
      end

      # on_booted (and READY=1 to systemd), once every worker accepted for
      # the first time; READY=1 again when a rolling restart is done.
      def notice_booted
        if @reloading && @restart_queue.empty?
          @reloading = false
          @systemd.ready("#{Server.workers_phrase(@count)} serving (restarted)")
        end
        return if @booted || @workers.each_value.count(&:ready) < @count

        retire_predecessors
        @booted = true
        @server.call_hook(:on_booted)
        @systemd.ready("#{Server.workers_phrase(@count)} serving on #{@listeners.map(&:address).join(', ')}")
      end

      # New workers keep dying before their app booted. During a rolling
      # restart with old workers still serving, the restart is abandoned and
      # they go on; after a hot restart, the old image's workers go on
      # serving (see #keep_predecessors); otherwise the master stops and
      # {Server#run} raises.
      def give_up_booting
        return keep_predecessors if @predecessors && !@stopping && predecessors_alive?

        old = @workers.each_value.select { |worker| worker.ready && !worker.stopping }
        if (@restart_queue.any? || @retiring.any?) && old.any?
          NeverBlock.logger.error do
            "NeverBlock::Server: #{@restart_queue.any? ? 'rolling restart' : 'replacing a worker'} abandoned: new workers " \
              "exited #{@boot_failures} times in a row before their app booted; the #{old.size} running worker(s) keep serving"
          end
          @restart_queue.clear
          abandon_rollout
          @retiring.each { |worker| worker.retiring = :abandoned } # not queued again
          @retiring.clear
          @generation = old.map(&:generation).max
          @boot_failures = 0
          return
        end

        begin_stop
        stop_all
        raise BootError, "the app failed to boot #{@boot_failures} times in a row" \
                         "#{@last_boot_failure ? " (#{@last_boot_failure})" : ''}; giving up (details in the log above)"
      end

      # Forks with the control listener's accepts held off: the worker then
      # knows (Control#ios) the connection it may have inherited, and closes
      # it; a connection kept open in a worker leaves its client waiting for
      # the end of its answer while that worker lives.
      def fork_holding_control(&block)
        @control ? @control.hold_accepts { fork(&block) } : fork(&block)
      end

      def spawn_worker(index, successor_of: nil)
        if @mold && (child = spawn_from_mold(index, @generation, successor_of))
          return @workers[child.pid] = child
        end

        status_reader, status_writer = IO.pipe
        command_writer, command_reader = UNIXSocket.pair # a socket: a promoted worker takes descriptors on it (Refork)
        generation = @generation
        @handoff&.prepare(index)
        pid = fork_holding_control do
          @systemd.close # only the master speaks to systemd
          master_only = [status_reader, command_writer, @wake_reader, @wake_writer, @alive_writer, @predecessors&.alive].compact +
                        (@workers.values + @molds).flat_map { |worker| [worker.status_reader, worker.commands] } +
                        (@control ? @control.ios : [])
          Worker.run(@server, index, status_writer, @alive_reader, master_only, self, commands: command_reader,
                     explain_failure: @boot_failures.zero? && index.zero?)
        end
        status_writer.close
        command_reader.close
        @workers[pid] = Child.new(index: index, pid: pid, generation: generation, status_reader: status_reader,
                                  commands: command_writer, max_requests: @settings.draw_max_requests,
                                  successor_of: successor_of, counters: @counters)
      end
    end
  end
end
