# frozen_string_literal: true

require "socket"

module NeverBlock
  class Server
    class Cluster
      # Reforking, the worker's side: a worker the master promoted
      # ({Refork}) becomes the mold the next generation is forked from.
      #
      # On `mold` from the master ({.promote}, in the worker's command
      # task) the worker stops as it would for a rolling restart, keeping
      # its listening sockets open. Once its loop has ended ({#run}, instead
      # of exiting) it waits up to {THREADS_SETTLE} seconds for every other
      # thread to be waiting: a thread that computes, or sits in a C call
      # that let go of the GVL, may hold a lock of libc's or a C
      # extension's, which a forked child would find locked forever. If one
      # is still busy, the worker reports "mold-refused" with its name and
      # frame, and exits as a stopped worker would. What it cannot see: a
      # lock taken by a thread that is now waiting in Ruby (a C extension
      # that holds its own mutex across a callback), and a Ruby Mutex a
      # waiting thread holds (Ruby lets a forked child take it; what it
      # protected may be half-changed).
      #
      # Then it closes what must not be shared with its children (its
      # database connections, NeverBlock's and ActiveRecord's; exporters'
      # buffers are flushed), calls the `before_refork` hook, compacts its
      # heap ({HeapWarmup}: Process.warmup, else a full GC and compaction)
      # so that the pages its children share stay unwritten, and reports
      # "molded". From then on it only forks: for each `spawn INDEX` from
      # the master, with the new worker's status pipe and command socket
      # attached, it forks a child that forks the worker and exits (the
      # master adopts the worker), and answers "spawned PID". The worker
      # renews the server ({Server#renew}) and runs as any other
      # ({Worker.run}): `on_worker_boot` (the app is loaded already),
      # heartbeats, the watchdog, recycling.
      #
      # TERM or INT ends the mold at once (it serves nothing); so does its
      # master's end of the command socket closing.
      class Mold
        # Seconds a promoted worker waits for its other threads to be idle.
        THREADS_SETTLE = 5

        # @api private
        # The `mold` command, in the worker's loop: stop serving, keep the
        # listening sockets; {Worker.run} then runs the mold.
        # @return [void]
        def self.promote(server)
          server.keep_listeners = true
          server.molding = true
          server.stop
        end

        # @return [Array<Thread>] this process's threads, other than the
        #   calling one, that are running (computing, or in a call that
        #   released the GVL) rather than waiting.
        def self.busy_threads
          Thread.list.select { |thread| !thread.equal?(Thread.current) && thread.status == "run" }
        end

        # @param server [Server] the worker's server, stopped.
        # @param index [Integer] the worker index it served.
        # @param status_writer [IO] its status pipe to the master.
        # @param commands [UNIXSocket] its command socket from the master.
        # @param alive_reader [IO] EOF once the master is gone (its children keep it).
        # @param cluster [Cluster] the master's, as forked.
        def initialize(server, index, status_writer, commands, alive_reader, cluster)
          @server = server
          @index = index
          @status_writer = status_writer
          @commands = commands
          @alive_reader = alive_reader
          @cluster = cluster
        end

        # Becomes the mold and forks workers until told to stop; exits the
        # process (0, or 1 when setting up failed).
        # @return [void] never returns.
        def run
          %w[TERM INT].each { |name| trap(name) { exit!(0) } }
          trap("QUIT", "IGNORE")
          if (why = fork_unsafe)
            Worker.report(@status_writer, "mold-refused #{why}")
            NeverBlock.logger.warn { "NeverBlock::Server: worker #{@index} (pid #{Process.pid}) will not be the mold: #{why}" }
            exit!(0)
          end
          prepare
          Process.setproctitle("neverblock mold (worker #{@index}, master #{@cluster.master_pid})")
          Worker.report(@status_writer, "molded")
          serve_spawns
          exit!(0)
        rescue StandardError => e
          Worker.report(@status_writer, "mold-refused #{Worker.summary(e)}")
          Worker.log_failure(@index, "could not become the mold", e, backtrace: true)
          exit!(1)
        end

        private

        # @return [String, nil] why forking now is unsafe, after waiting up
        #   to THREADS_SETTLE seconds for busy threads to wait.
        def fork_unsafe
          deadline = Clock.now + THREADS_SETTLE
          while (busy = Mold.busy_threads).any?
            return describe_busy(busy) if Clock.now > deadline

            sleep 0.01
          end
          nil
        end

        def describe_busy(threads)
          listed = threads.first(3).map do |thread|
            frames = thread.backtrace || []
            frame = frames.find { |line| !line.start_with?("<internal:") } || frames.first # the app's line, not Kernel#loop's
            "#{thread.name || thread.inspect[/#<Thread:0x\h+/]}#{" at #{frame}" if frame}"
          end
          "#{threads.size} other thread(s) still running after #{THREADS_SETTLE} s (#{listed.join('; ')}); " \
            "one may hold a lock a forked child would never see released"
        end

        def prepare
          ConnectionPool.active.each(&:disconnect_all)
          disconnect_active_record
          OpenTelemetry.tracer_provider.force_flush if defined?(OpenTelemetry) && OpenTelemetry.respond_to?(:tracer_provider)
          @server.call_hook(:before_refork, @index)
          $stdout.flush
          $stderr.flush
          HeapWarmup.call(fallback: true)
        end

        def disconnect_active_record
          return unless defined?(::ActiveRecord::Base) && ::ActiveRecord::Base.respond_to?(:connection_handler)

          ::ActiveRecord::Base.connection_handler.connection_pool_list(:all).each(&:disconnect!)
        rescue StandardError => e
          NeverBlock.logger.warn { "NeverBlock::Server: the mold could not disconnect ActiveRecord: #{e.class}: #{e.message}" }
        end

        def serve_spawns
          loop do
            message, _address, _flags, *controls = @commands.recvmsg(64, 0, 256, scm_rights: true)
            return if message.nil? || message.empty? # the master is gone

            ios = controls.flat_map { |control| control.unix_rights || [] }
            index = message[/\Aspawn (\d+)\n\z/, 1]
            if index && ios.size == 2
              fork_worker(Integer(index), *ios)
            else
              ios.each(&:close)
            end
          end
        end

        # Forks the worker for `index` through a child that exits at once,
        # so that the master (a subreaper) becomes the worker's parent.
        def fork_worker(index, status_writer, commands)
          reader, writer = IO.pipe
          middle = fork do
            reader.close
            pid = fork do
              writer.close
              become_worker(index, status_writer, commands)
            end
            writer.write(pid.to_s)
            exit!(0)
          end
          writer.close
          [status_writer, commands].each(&:close)
          Process.wait(middle)
          pid = reader.read
          @commands.send(pid.match?(/\A\d+\z/) ? "spawned #{pid}\n" : "failed\n", 0)
        ensure
          [reader, writer].each { |io| io.close unless io.closed? }
        end

        def become_worker(index, status_writer, commands)
          [@status_writer, @commands].each(&:close)
          status_writer.sync = true # (IO.pipe's writer is; one made from a received descriptor is not)
          @server.keep_listeners = false
          @server.molding = false
          @server.renew
          Worker.run(@server, index, status_writer, @alive_reader, [], @cluster, commands: commands)
        end
      end
    end
  end
end
