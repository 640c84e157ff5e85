# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../support/serve_processes"
require "tmpdir"
require "socket"

# systemd's protocol without systemd: a NOTIFY_SOCKET datagram listener in
# the test (Type=notify, WatchdogSec=) and Debian's systemd-socket-activate
# (socket activation), around real `neverblock serve` processes.
class ServerSystemdTest < PlainTest
  include ServeProcesses

  def setup
    super
    @dir = Dir.mktmpdir("nb-systemd")
    @notify_path = File.join(@dir, "notify")
    @notify = Socket.new(:UNIX, :DGRAM)
    @notify.bind(Addrinfo.unix(@notify_path))
    @messages = []
  end

  def teardown
    super
    @notify&.close
    FileUtils.rm_rf(@dir)
  end

  def test_ready_after_the_workers_accept_watchdog_reloading_and_stopping
    server = serve("pids.ru", "-w", "2", env: { "NOTIFY_SOCKET" => @notify_path, "WATCHDOG_USEC" => "400000" })
    ready = next_message { |message| message.include?("READY=1") }
    assert_match(/^STATUS=2 workers serving on tcp:/, ready)
    assert_equal 2, worker_pids(server[:pid]).size, "READY=1 only once both workers were up"
    pids(server)
    2.times { next_message { |message| message == "WATCHDOG=1" } } # every 0.2 s, half of WatchdogSec

    Process.kill("USR2", server[:pid])
    reloading = next_message { |message| message.include?("RELOADING=1") }
    assert_match(/^MONOTONIC_USEC=\d+$/, reloading)
    assert_match(/^STATUS=2 workers serving \(restarted\)$/, next_message { |message| message.include?("READY=1") })

    Process.kill("TERM", server[:pid])
    assert_match(/^STATUS=stopping 2 workers$/, next_message { |message| message.include?("STOPPING=1") })
    assert wait_exit(server).success?
    assert(@messages.none? { |message| message.include?("READY=1") && message.include?("worker ") }, "workers never notify")
  end

  def test_one_process_notifies_too
    server = serve("pids.ru", "-w", "0", env: { "NOTIFY_SOCKET" => @notify_path })
    assert_match(/^STATUS=serving on tcp:/, next_message { |message| message.include?("READY=1") })
    Process.kill("TERM", server[:pid])
    next_message { |message| message.include?("STOPPING=1") }
    assert wait_exit(server).success?
  end

  def test_one_process_pings_the_watchdog_from_its_loop_until_it_stops
    server = serve("pids.ru", "-w", "0", env: { "NOTIFY_SOCKET" => @notify_path, "WATCHDOG_USEC" => "400000" })
    next_message { |message| message.include?("READY=1") }
    2.times { next_message { |message| message == "WATCHDOG=1" } } # every 0.2 s, half of WatchdogSec
    Process.kill("TERM", server[:pid])
    next_message { |message| message.include?("STOPPING=1") }
    assert wait_exit(server).success?
  end

  def test_socket_activation_serves_the_sockets_systemd_passed
    port = free_port
    path = File.join(@dir, "app.sock")
    reader, writer = IO.pipe
    command = [RbConfig.ruby, EXE, "serve", File.join(FIXTURES, "pids.ru"), "-w", "1", "-b", "tcp://127.0.0.1:#{port}"]
    pid = if system("command -v systemd-socket-activate >/dev/null")
            # It starts the command with a clean environment: -E passes ours (Bundler's).
            Process.spawn("systemd-socket-activate", "-l", "127.0.0.1:#{port}", "-l", path,
                          *ENV.keys.grep_v(/\ALISTEN_/).flat_map { |name| ["-E", name] }, *command,
                          out: writer, err: writer, pgroup: true)
          else
            # A chroot Ruby's pass (no systemd there): what systemd does, by hand.
            passed = [TCPServer.new("127.0.0.1", port), UNIXServer.new(path)]
            begin
              Process.spawn("/bin/sh", "-c", 'LISTEN_PID=$$ LISTEN_FDS=2 exec "$@"', "sh", *command,
                            3 => passed[0], 4 => passed[1], out: writer, err: writer, pgroup: true)
            ensure
              passed.each(&:close)
            end
          end
    writer.close
    server = { pid: pid, out: reader, lines: [] }
    (@servers ||= []) << server
    # systemd-socket-activate listens, then execs the server on the first connection.
    response = eventually { Net::HTTP.start("127.0.0.1", port, read_timeout: 60) { |http| http.get("/") } rescue nil } # rubocop:disable Style/RescueModifier
    assert_equal "200", response.code
    line = wait_for_line(server, /serving .* on /)
    assert_includes line, "tcp://127.0.0.1:#{port}"
    assert_includes line, "unix://#{path}", "a passed socket no bind named is served too"
    unix = UNIXSocket.new(path)
    unix.write("GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert_match(%r{\AHTTP/1\.1 200 }, unix.read)
    unix.close
    Process.kill("TERM", pid)
    assert wait_exit(server).success?
    assert File.socket?(path), "systemd's socket file is left to systemd"
  end

  private

  # The next datagram matching the block (those before it are kept in @messages).
  def next_message(timeout: 20)
    deadline = now + timeout
    loop do
      remaining = deadline - now
      flunk "no matching notification within #{timeout} s; got #{@messages.inspect}" unless remaining.positive?
      next unless @notify.wait_readable(remaining)

      message = @notify.recv(4096)
      @messages << message
      return message if yield(message)
    end
  end
end
