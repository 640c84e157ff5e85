# frozen_string_literal: true

require "socket"

module NeverBlock
  class Server
    class Cluster
      # Reforking, the master's side (included in {Cluster}): the next
      # generation of workers is forked from a worker that warmed up, not
      # from the master, so that what warm-up built in it (caches filled on
      # first use, code loaded lazily, inline caches, YJIT's compiled code)
      # is shared between the new workers' pages instead of built again in
      # each of them.
      #
      # 1. A worker of the current generation is promoted: when it has served
      #    the next count of `refork_after` (the last repeats, unless it
      #    is `false`) and, with `refork_when`, reported that it is warm; or
      #    on demand (`URG`, `neverblock ctl refork`: the one that served
      #    most, a warm one first). The master writes `mold` to it.
      # 2. It stops accepting, finishes its requests (its siblings serve on),
      #    checks that no other thread of its own may hold a lock across a
      #    fork, closes what children must not share and reports "molded"
      #    ({Mold}); or "mold-refused WHY", and the generation stays.
      # 3. The generation is replaced one index at a time, the new worker
      #    ready before its predecessor is asked to stop (as a rolling
      #    restart, {#continue_restart}), each new worker forked by the mold
      #    ({#spawn_from_mold}): the mold forks, its child forks the worker
      #    and exits, and the worker, an orphan, is adopted by the master,
      #    which is a child subreaper (Linux's PR_SET_CHILD_SUBREAPER). So
      #    the master waits for it, signals it and watches it like any
      #    worker it forked itself.
      # 4. The previous mold, if any, is stopped. Every worker the master
      #    starts from then on (a crash, recycling, TTIN) comes from the
      #    mold, until a rolling restart (USR2), which loads the app anew
      #    from the master and starts the `refork_after` counts again. A
      #    mold that dies or does not answer is dropped, and workers come
      #    from the master again.
      module Refork
        # Seconds the master waits for the mold to report the pid of a
        # worker it forked.
        SPAWN_REPLY_TIMEOUT = 10

        # prctl(2) option: orphaned descendants are reparented to this process.
        PR_SET_CHILD_SUBREAPER = 36

        # prctl's system call number, per architecture.
        PRCTL = { "x86_64" => 157, "aarch64" => 167, "arm64" => 167, "riscv64" => 167, "i686" => 172,
                  "i386" => 172, "powerpc64le" => 171, "s390x" => 172 }.freeze

        # @return [String, nil] what this platform lacks for reforking, nil
        #   when it has it.
        def self.unavailable
          return "reforking needs Linux (PR_SET_CHILD_SUBREAPER), this is #{RUBY_PLATFORM}" unless RUBY_PLATFORM.include?("linux")
          return nil if Kernel.respond_to?(:syscall, true) && PRCTL[cpu]
          return nil if fiddle

          "reforking needs prctl(2): through Kernel#syscall (this Ruby #{Kernel.respond_to?(:syscall, true) ? "has it, but prctl's number on #{cpu} is unknown" : 'lacks it'}) or the fiddle gem (not loadable)"
        end

        # Makes this process a child subreaper, once.
        # @return [void]
        # @raise [Error] when the platform lacks it or prctl fails.
        def self.subreaper!
          return if @subreaper == Process.pid

          why = unavailable and raise Error, why
          if Kernel.respond_to?(:syscall, true) && PRCTL[cpu]
            verbose = $VERBOSE
            $VERBOSE = nil # Kernel#syscall's "we plan to remove" notice
            begin
              Kernel.send(:syscall, PRCTL.fetch(cpu), PR_SET_CHILD_SUBREAPER, 1)
            ensure
              $VERBOSE = verbose
            end
          elsif fiddle.call(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0
            raise SystemCallError.new("prctl", Fiddle.last_error)
          end
          @subreaper = Process.pid
        rescue SystemCallError => e
          raise Error, "reforking needs prctl(PR_SET_CHILD_SUBREAPER), which failed: #{e.message}"
        end

        def self.cpu
          RbConfig::CONFIG["host_cpu"]
        end

        # libc's prctl through Fiddle, where Kernel#syscall is gone; nil
        # when fiddle cannot be loaded (a bundled gem since Ruby 3.5).
        def self.fiddle
          return @fiddle if defined?(@fiddle)

          @fiddle = begin
            require "fiddle"
            Fiddle::Function.new(Fiddle.dlopen(nil)["prctl"], [Fiddle::TYPE_INT] + [Fiddle::TYPE_LONG] * 4, Fiddle::TYPE_INT)
          rescue LoadError, StandardError # (Fiddle::DLError: no prctl in this libc)
            nil
          end
        end
        private_class_method :cpu, :fiddle

        # @api private
        # @return [Child, nil] the mold the workers fork from now.
        attr_reader :mold

        # @api private
        # @return [Integer] generations forked from a mold so far.
        def reforks
          @reforks || 0
        end

        private

        def start_reforking
          @reforks = 0
          @refork_counts = @settings.refork_after.dup
          @refork_wanted = false
          @cold_said = nil # the generation whose cold workers the log named (refork_when)
          @mold = @candidate = nil
          @molds = [] # every mold process not yet waited for (the current one and those stopping)
        end

        # URG, `ctl refork`: promote a worker at the next turn.
        def refork_requested
          if (why = Refork.unavailable)
            NeverBlock.logger.error { "NeverBlock::Server: refork refused: #{why}" }
          else
            @refork_wanted = true
          end
        end

        # @return [Boolean] a worker is being promoted.
        def promoting?
          !@candidate.nil?
        end

        # Promotes a worker when one is due and nothing else replaces
        # workers; gives up on a candidate that does not report in time.
        def continue_refork
          return watch_candidate if @candidate
          return unless @refork_wanted || @refork_counts.first
          return if @stopping || @boot_paused || !@restart_queue.empty? || !@retiring.empty?

          serving = @workers.each_value.select do |worker|
            worker.ready && !worker.stopping && !worker.retiring && !worker.hung_at && worker.generation == @generation
          end
          return if serving.size < @count

          if @refork_wanted
            promote(serving.max_by { |worker| [warm?(worker) ? 1 : 0, worker.requests] }, "was chosen (refork asked for)")
          else
            promote_due(serving, @refork_counts.first)
          end
        end

        # Promotes a worker that served `count` requests and is warm
        # (`refork_when`); says once per generation that one served them
        # but is not warm yet.
        def promote_due(serving, count)
          reached = serving.select { |worker| worker.requests >= count }
          if (due = reached.find { |worker| warm?(worker) })
            promote(due, "served #{due.requests} requests (refork_after #{count})#{' and is warm (refork_when)' if @settings.refork_when}")
          elsif reached.any? && @cold_said != @generation
            @cold_said = @generation
            NeverBlock.logger.info do
              "NeverBlock::Server: #{reached.first} served #{reached.first.requests} requests (refork_after #{count}) but is not " \
                "warm yet (refork_when); the first worker that is becomes the mold"
            end
          end
        end

        # @return [Boolean] `refork_when` returned true in it (always, without `refork_when`).
        def warm?(worker)
          @settings.refork_when.nil? || worker.warm
        end

        def promote(worker, why)
          Refork.subreaper!
          @refork_wanted = false
          @refork_counts.shift if @refork_counts.size > 1 # the last repeats (false: none after it)
          @candidate = worker
          @candidate_deadline = Clock.now + @server.limits.shutdown_timeout + Mold::THREADS_SETTLE + 30
          worker.promoting = true
          NeverBlock.logger.info do
            "NeverBlock::Server: #{worker} #{why}: promoting it to mold; the next generation forks from it, one worker at a time"
          end
          worker.command("mold")
        end

        def watch_candidate
          return unless Clock.now > @candidate_deadline && !@candidate.hung_at

          @candidate.hang("did not become a mold in time")
        end

        # The candidate reported: it is the mold now, and the generation is
        # replaced from it.
        def molded(worker)
          @candidate = nil
          if @stopping || !@restart_queue.empty? # a stop or a rolling restart came meanwhile
            worker.terminate
            return
          end

          @workers.delete(worker.pid)
          @handoff&.vacate(worker.index, worker.pid)
          previous = @mold
          @mold = worker
          @molds << worker
          previous&.terminate
          @reforks += 1
          @generation += 1
          @restart_queue = [worker.index] + ((0...@count).to_a - [worker.index])
          begin_rollout("refork", "forked from the mold (pid #{worker.pid})")
          NeverBlock.logger.info { "NeverBlock::Server: #{worker} is the mold; forking generation #{@generation} from it" }
        end

        def mold_refused(worker)
          @candidate = nil
          worker.expect_exit # it stopped serving, and exits; its index is filled again
          NeverBlock.logger.warn { "NeverBlock::Server: #{worker} refused to become the mold: #{worker.refusal}" }
        end

        # A process the master waited for that was a mold or the candidate.
        # @return [Boolean] whether it was a mold.
        def mold_exited(pid, status)
          @candidate = nil if @candidate&.pid == pid
          mold = @molds.find { |process| process.pid == pid } or return false

          @molds.delete(mold)
          @counters.forget(pid)
          mold.close
          return true unless @mold.equal?(mold)

          NeverBlock.logger.warn { "NeverBlock::Server: the mold (pid #{pid}) exited (#{describe(status)}); workers fork from the master again" }
          @mold = nil
          true
        end

        # A rolling restart loads the app anew: its workers come from the
        # master, and the refork counts start again.
        def drop_mold
          forget_mold
          @refork_counts = @settings.refork_after.dup
        end

        # Stops the mold (it is waited for as it exits); workers fork from
        # the master from now on.
        def forget_mold
          @mold&.terminate
          @mold = nil
        end

        # Asks the mold to fork the worker for `index`; the master keeps its
        # ends of the new pipes, the mold gets the worker's.
        # @return [Child, nil] nil when the mold did not answer (it is then
        #   dropped, and the caller forks from the master).
        def spawn_from_mold(index, generation, successor_of)
          status_reader, status_writer = IO.pipe
          commands, worker_commands = UNIXSocket.pair
          @handoff&.prepare(index)
          pid = ask_mold(index, status_writer, worker_commands)
          unless pid
            [status_reader, commands].each(&:close)
            return nil
          end

          Child.new(index: index, pid: pid, generation: generation, status_reader: status_reader, commands: commands,
                    max_requests: @settings.draw_max_requests, successor_of: successor_of, counters: @counters)
        ensure
          [status_writer, worker_commands].each { |io| io&.close }
        end

        def ask_mold(index, status_writer, worker_commands)
          channel = @mold.commands
          channel.sendmsg("spawn #{index}\n", 0, nil, Socket::AncillaryData.unix_rights(status_writer, worker_commands))
          reply = channel.wait_readable(SPAWN_REPLY_TIMEOUT) && channel.recv(64)
          pid = reply.to_s[/\Aspawned (\d+)\n\z/, 1]
          return Integer(pid) if pid

          NeverBlock.logger.error do
            "NeverBlock::Server: the mold #{@mold} did not fork worker #{index} (#{reply ? reply.inspect : 'no answer'}); " \
              "workers fork from the master again"
          end
          forget_mold
        rescue SystemCallError, IOError => e
          NeverBlock.logger.error { "NeverBlock::Server: the mold #{@mold} is unreachable (#{e.class}); workers fork from the master again" }
          forget_mold
        end
      end
    end
  end
end
