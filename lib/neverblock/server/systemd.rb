# frozen_string_literal: true

require "socket"

module NeverBlock
  class Server
    # systemd's side of a service, with the standard library only (no
    # libsystemd):
    #
    # - {Notifier}: `Type=notify`. When NOTIFY_SOCKET is set, the master (or
    #   the one process with `workers: 0`) sends `READY=1` once every worker
    #   accepts, `RELOADING=1` and `READY=1` around a rolling restart,
    #   `STOPPING=1` when it stops, `STATUS=` lines, and with `WatchdogSec=`
    #   (WATCHDOG_USEC) `WATCHDOG=1` every half of it while its own loop turns.
    # - {.claim}: socket activation. When LISTEN_PID is this process and
    #   LISTEN_FDS is N, descriptors 3 to 3+N-1 are listening sockets systemd
    #   opened (a `.socket` unit); a bind address that matches one uses it
    #   instead of binding ({Listener#listen}); one that matches no bind
    #   address is served too ({.unclaimed}). The variables are removed once
    #   read, so that no child takes them for its own.
    module Systemd
      # [descriptor, Addrinfo] of each socket systemd passed, nil once taken.
      @inherited = nil
      @lock = Thread::Mutex.new

      class << self
        # A passed socket that listens where `host`:`port` (TCP) or `path`
        # (unix) would; the caller adopts it instead of binding.
        # @return [TCPServer, UNIXServer, nil]
        def claim(host: nil, port: nil, path: nil)
          @lock.synchronize do
            inherited.each_with_index do |(fd, address), index|
              next unless fd && matches?(address, host, port, path)

              @inherited[index] = nil
              return server_for(fd, address)
            end
            nil
          end
        end

        # @return [Array<TCPServer, UNIXServer>] passed sockets no bind address
        #   matched (and which nobody has claimed since); each is then the caller's.
        def unclaimed
          @lock.synchronize do
            left = inherited.compact.map { |fd, address| server_for(fd, address) }
            @inherited = []
            left
          end
        end

        private

        def inherited
          @inherited ||= read_listen_fds
        end

        # systemd's LISTEN_FDS (descriptors from 3), and the master's own
        # NEVERBLOCK_LISTEN_FDS (a comma-separated list), which a hot restart
        # passes to the image it executes ({Cluster::HotRestart}).
        def read_listen_fds
          fds = []
          pid = ENV["LISTEN_PID"]
          count = Integer(ENV["LISTEN_FDS"] || "0", exception: false) || 0
          fds.concat((3...3 + count).to_a) if pid && Integer(pid, exception: false) == Process.pid
          fds.concat(ENV["NEVERBLOCK_LISTEN_FDS"].to_s.split(",").filter_map { |fd| Integer(fd, exception: false) })
          %w[LISTEN_PID LISTEN_FDS LISTEN_FDNAMES NEVERBLOCK_LISTEN_FDS].each { |name| ENV.delete(name) }
          fds.filter_map do |fd|
            probe = Socket.for_fd(fd)
            probe.autoclose = false # only looked at: the server made from the descriptor owns it
            [fd, probe.local_address]
          rescue SystemCallError, ArgumentError
            nil # not a socket (closed meanwhile): nothing to serve there
          end
        end

        def server_for(fd, address)
          server = address.unix? ? UNIXServer.for_fd(fd) : TCPServer.for_fd(fd)
          server.close_on_exec = true
          server
        end

        def matches?(address, host, port, path)
          if path
            address.unix? && address.unix_path == path
          elsif address.ip? && port && port.positive? && address.ip_port == port
            wildcard = %w[0.0.0.0 :: [::]].include?(host)
            wildcard ? %w[0.0.0.0 ::].include?(address.ip_address) : Addrinfo.ip(host.delete("[]")).ip_address == address.ip_address
          else
            false
          end
        rescue SocketError, SystemCallError
          false
        end
      end

      # Sends systemd's notifications (sd_notify's protocol: one datagram of
      # `KEY=value` lines to the unix socket NOTIFY_SOCKET names, `@` for the
      # abstract namespace). Quiet without NOTIFY_SOCKET. A send that fails
      # is logged once and ignored: supervision goes on without systemd.
      class Notifier
        # @param env [Hash] the environment to read NOTIFY_SOCKET,
        #   WATCHDOG_USEC and WATCHDOG_PID from.
        def initialize(env = ENV)
          path = env["NOTIFY_SOCKET"].to_s
          @address = path.empty? ? nil : Addrinfo.unix(path.start_with?("@") ? "\0#{path[1..]}" : path, :DGRAM)
          usec = Integer(env["WATCHDOG_USEC"] || "", exception: false)
          watchdog_pid = Integer(env["WATCHDOG_PID"] || "", exception: false)
          @watchdog = usec&.positive? && (watchdog_pid.nil? || watchdog_pid == Process.pid) ? usec / 1_000_000.0 : nil
          @pinged_at = nil
          @failed = false
          @socket = nil
          @pings = nil # the task of #ping_watchdog_while_serving
        end

        # The one process of `workers: 0` is the service systemd watches (a
        # master does it for its workers, see {Cluster}): READY=1 now,
        # WATCHDOG=1 from a task of the running loop, STOPPING=1 at
        # {#stopping}. Called on the serving loop.
        # @param status [String]
        # @return [Notifier, nil] nil when systemd does not listen.
        def self.serving(status)
          notifier = new
          return nil unless notifier.enabled?

          notifier.ready(status)
          notifier.ping_watchdog_while_serving
          notifier
        end

        # @return [Boolean] whether systemd listens (NOTIFY_SOCKET is set).
        def enabled?
          !@address.nil?
        end

        # @return [Float, nil] seconds between watchdog pings (half of
        #   WatchdogSec), nil without a watchdog.
        def watchdog_interval
          @watchdog && @watchdog / 2
        end

        # @param status [String]
        # @return [void]
        def ready(status)
          notify("READY=1", "STATUS=#{status}")
        end

        # A reload (a rolling restart) begins; {#ready} when it is done.
        # @return [void]
        def reloading(status)
          now = Process.clock_gettime(Process::CLOCK_MONOTONIC, :microsecond)
          notify("RELOADING=1", "MONOTONIC_USEC=#{now}", "STATUS=#{status}")
        end

        # Also ends the pings of {#ping_watchdog_while_serving}.
        # @return [void]
        def stopping(status = "stopping")
          notify("STOPPING=1", "STATUS=#{status}")
          @pings&.cancel
        end

        # @return [void]
        def status(text)
          notify("STATUS=#{text}")
        end

        # `WATCHDOG=1`, when half of WatchdogSec passed since the last.
        # @return [void]
        def watchdog
          return unless @watchdog && @address

          now = Clock.now
          return if @pinged_at && now - @pinged_at < watchdog_interval

          @pinged_at = now
          notify("WATCHDOG=1")
        end

        # With a watchdog: `WATCHDOG=1` every {#watchdog_interval} from a
        # task of the running loop, until {#stopping}. A loop held by a fiber
        # then misses its pings, and systemd restarts the service.
        # @return [void]
        def ping_watchdog_while_serving
          interval = watchdog_interval or return

          @pings = NeverBlock.spawn(detached: true, internal: true) do
            loop do
              watchdog
              NeverBlock.sleep(interval)
            end
          end
        end

        # @return [Float, nil] seconds until the next watchdog ping is due.
        def watchdog_due_in
          return nil unless @watchdog && @address
          return 0.0 unless @pinged_at

          [@pinged_at + watchdog_interval - Clock.now, 0.0].max
        end

        # Closes its socket (a forked child must not share it).
        # @return [void]
        def close
          @socket&.close
          @socket = nil
        end

        private

        def notify(*lines)
          return unless @address

          @socket ||= Socket.new(:UNIX, :DGRAM)
          @socket.send(lines.join("\n"), 0, @address)
        rescue SystemCallError, IOError => e
          return if @failed

          @failed = true
          NeverBlock.logger.warn { "NeverBlock::Server: could not notify systemd at #{@address.unix_path.inspect}: #{e.message}" }
        end
      end
    end
  end
end
