# frozen_string_literal: true

require "json"

module NeverBlock
  class Server
    class Cluster
      # One forked worker process, as the master sees it: what the worker
      # reported on its status pipe, and the signals the master sends it.
      #
      # Called by {Cluster} only (spawn, reap, the watchdog, recycling, the
      # restarts), and read by the control listener ({Control},
      # {Prometheus}) from its own thread: every field a reader sees is a
      # plain value set in one assignment.
      #
      # The worker writes one line per note ({Worker.report}): "booted" once
      # its app is loaded, "ready" once it accepts, "beat REQUESTS" while its
      # loop turns ("metrics JSON" with each beat when the master has a
      # control listener; both once more when it stopped serving, added up
      # by {Counters}), "dumped" when it logged its tasks, "tasks JSON"
      # when the control listener asked, "warm" once `refork_when` returned
      # true in it, "boot-failed WHY" before it exits
      # with its app not loaded. EOF means it exited.
      class Child
        # A status line is shorter (one write each, atomic on a pipe).
        STATUS_READ = 4096

        # @return [Integer] the worker's slot, 0...count.
        attr_reader :index
        # @return [Integer]
        attr_reader :pid
        # @return [Integer] the rolling restart it was started in.
        attr_reader :generation
        # @return [Time] when it was forked (wall clock, for /stats).
        attr_reader :started_at
        # @return [Float] when it was forked (monotonic seconds).
        attr_reader :spawned
        # @return [IO] the master's end of the worker's status pipe.
        attr_reader :status_reader
        # @return [IO] the master's end of the pipe of commands to it.
        attr_reader :commands
        # @return [Integer, nil] its share of `max_requests`, with jitter.
        attr_reader :max_requests
        # @return [Integer, nil] the pid of the worker it replaces (recycling).
        attr_reader :successor_of
        # @return [Boolean] its app is loaded: a death from now on is not a boot failure.
        attr_reader :booted
        # @return [Boolean] it accepts connections (a rolling restart waits for that).
        attr_reader :ready
        # @return [Float, nil] its last heartbeat (monotonic seconds).
        attr_reader :beat_at
        # @return [Integer] requests it started, as of that beat.
        attr_reader :requests
        # @return [String, nil] why its app did not boot, as it reported.
        attr_reader :failure
        # @return [Hash, nil] its last {Metrics#snapshot}.
        attr_reader :metrics
        # @return [Array, nil] its last task dump.
        attr_reader :tasks
        # @return [Float, nil] when that dump came (monotonic seconds).
        attr_reader :tasks_at
        # @return [Float, nil] when the watchdog asked it for its dump.
        attr_reader :hung_at
        # @return [Boolean] it was asked to stop (TERM): its exit is expected.
        attr_reader :stopping
        # @return [Symbol, nil] why it is being replaced gracefully
        #   (`:requests`, `:memory`; `:abandoned` when that was given up).
        attr_accessor :retiring
        # @return [Boolean] it was asked to become the mold ({Refork}).
        attr_accessor :promoting
        # @return [String, nil] why it refused to become the mold.
        attr_reader :refusal
        # @return [Boolean] `refork_when` returned true in it ({Refork}).
        attr_reader :warm

        # @param index [Integer]
        # @param pid [Integer]
        # @param generation [Integer]
        # @param status_reader [IO]
        # @param commands [IO]
        # @param max_requests [Integer, nil]
        # @param successor_of [Integer, nil]
        # @param counters [Counters, nil] where its heartbeats' counts are added up.
        def initialize(index:, pid:, generation:, status_reader:, commands:, max_requests: nil, successor_of: nil,
                       counters: nil)
          @index = index
          @pid = pid
          @generation = generation
          @status_reader = status_reader
          @commands = commands
          @max_requests = max_requests
          @successor_of = successor_of
          @counters = counters
          @started_at = Time.now
          @spawned = Clock.now
          @requests = 0
          @booted = @ready = @stopping = @killed = @promoting = @warm = false
          @partial = nil # the start of a status line not yet read whole
        end

        # Reads what the worker wrote since the last call and yields each
        # note the master acts on: `:booted` (the first time), `:dumped`,
        # `:max_requests` (it reached its share), `:molded` and
        # `:mold_refused` (how a promotion went, {Refork}). Closes the pipe at EOF.
        # @yieldparam note [Symbol]
        # @return [Boolean] whether there was something to read.
        def read_status(&block)
          data = @status_reader.read_nonblock(STATUS_READ, exception: false)
          @status_reader.close if data.nil?
          return false unless data.is_a?(String)

          note_status(data, &block)
          true
        end

        # What a dead worker wrote that the master had not read yet (it may
        # have booted just before it died); then both pipes are closed.
        # @yieldparam note [Symbol] as {#read_status}.
        # @return [void]
        def drain_status(&block)
          nil while !@status_reader.closed? && read_status(&block)
        rescue IOError
          nil
        ensure
          close
        end

        # Sends signal `name` to the worker.
        # @return [Boolean] false when it is gone.
        def signal(name)
          Cluster.signal(@pid, name)
        end

        # Asks the worker to stop gracefully: TERM when it is replaced (the
        # others serve on), INT when the whole server stops (it then also
        # answers what the kernel queued, see {Server#stop}).
        # @param last [Boolean]
        # @return [void]
        def terminate(last: false)
          @stopping = true
          signal(last ? "INT" : "TERM")
        end

        # The watchdog found it hung: asks it for its task dump (QUIT); the
        # master kills it ({#kill_hung}) once that is logged or after
        # {Watchdog::DUMP_GRACE}.
        # @param why [String] what the log says it did.
        # @return [void]
        def hang(why)
          @hung_at = Clock.now
          NeverBlock.logger.error do
            "NeverBlock::Server: #{self} #{why}; asking it for its tasks (QUIT), then killing it"
          end
          signal("QUIT")
        end

        # It stops by itself (a refused promotion): its exit is expected.
        # @return [void]
        def expect_exit
          @stopping = true
        end

        # Kills a hung worker, once.
        # @return [void]
        def kill_hung
          return if @killed

          @killed = true
          signal("KILL")
        end

        # Kills a worker that did not stop in time.
        # @return [void]
        def kill
          NeverBlock.logger.warn { "NeverBlock::Server: #{self} did not stop in time; killing it" }
          signal("KILL")
        end

        # What the watchdog finds wrong with it at `now`, or nil: it has not
        # accepted `worker_boot_timeout` after it was started, or its loop
        # sent no heartbeat for `worker_timeout`.
        # @param now [Float] monotonic seconds.
        # @param settings [Settings]
        # @return [String, nil]
        def overdue(now, settings)
          if !@ready
            boot_timeout = settings.worker_boot_timeout
            "has not accepted #{boot_timeout} s after it was started (worker_boot_timeout)" if boot_timeout && now - @spawned > boot_timeout
          elsif (timeout = settings.worker_timeout) && now - @beat_at > timeout
            if stopped?
              "has not turned its event loop for #{timeout} s (worker_timeout): it is stopped (SIGSTOP, or a debugger holds it)"
            else
              "has not turned its event loop for #{timeout} s (worker_timeout): a request holds it " \
                "(computing, a C call holding the GVL, a deadlock)"
            end
          end
        end

        # @return [Boolean] whether the process is stopped (state T or t in
        #   /proc: SIGSTOP, SIGTSTP, a tracer), not running or waiting.
        def stopped?
          stat = File.read("/proc/#{@pid}/stat")
          %w[T t].include?(stat[stat.rindex(")") + 2])
        rescue SystemCallError, NoMethodError
          false
        end

        # Writes a command line to the worker ({Worker.read_commands}).
        # @return [Boolean] false when it has exited meanwhile.
        def command(name)
          @commands.write("#{name}\n")
          true
        rescue IOError, SystemCallError
          false
        end

        # @return [Hash] its entry in {Cluster#stats}.
        def to_h
          { index: @index, pid: @pid, generation: @generation, ready: @ready, started_at: @started_at,
            requests: @requests, retiring: @retiring }
        end

        # @return [String] "worker 1 (pid 1234)", as the log names it.
        def to_s
          "worker #{@index} (pid #{@pid})"
        end

        # Closes the master's ends of its pipes.
        # @return [void]
        def close
          [@status_reader, @commands].each { |io| io.close unless io.closed? }
        end

        private

        # `data` may end in the middle of a line (a read stops at
        # STATUS_READ bytes): that part waits for the rest.
        def note_status(data, &block)
          data = "#{@partial}#{data}"
          complete = data.end_with?("\n")
          lines = data.split("\n")
          @partial = complete ? nil : lines.pop
          lines.each { |line| note_line(line, &block) }
        end

        def note_line(line)
          case line
          when /\Abeat (\d+)\z/
            @beat_at = Clock.now
            @requests = Integer(Regexp.last_match(1))
            @counters&.beat(@index, @pid, @requests)
            yield :max_requests if @max_requests && @requests >= @max_requests && !@promoting
          when /\Aboot-failed (.*)\z/ then @failure = Regexp.last_match(1)
          when "booted"
            unless @booted
              @booted = true
              yield :booted
            end
          when "ready"
            @ready = true
            @beat_at = Clock.now
          when "dumped" then yield :dumped if @hung_at
          when "warm" then @warm = true
          when "molded" then yield :molded if @promoting
          when /\Amold-refused (.*)\z/
            @refusal = Regexp.last_match(1)
            yield :mold_refused if @promoting
          when /\Ametrics (.*)\z/
            @metrics = JSON.parse(Regexp.last_match(1))
            @counters&.metrics(@index, @pid, @metrics)
          when /\Atasks (.*)\z/
            @tasks = JSON.parse(Regexp.last_match(1))
            @tasks_at = Clock.now
          end
        end
      end
    end
  end
end
