# frozen_string_literal: true

require "json"
require "net/http"
require "timeout"
require "etc"
require_relative "free_port"

# Runs `neverblock serve` in child processes and talks to them over HTTP.
module ServeProcesses
  include FreePort

  EXE = File.expand_path("../../exe/neverblock", __dir__)
  FIXTURES = File.expand_path("../fixtures/server", __dir__)

  def teardown
    @servers&.each do |server|
      Process.kill("KILL", server[:pid])
    rescue Errno::ESRCH
      nil
    ensure
      kill_group(server[:pid])
      begin
        Process.wait(server[:pid])
      rescue Errno::ECHILD
        nil
      end
      server[:out].close unless server[:out].closed?
    end
    super
  end

  # Starts `neverblock serve APP ARGS` in its own process group and returns
  # once it printed where it listens. APP: a fixture's name, an absolute
  # path, or with chdir: a path in that directory (config.ru of an app).
  def serve(app, *args, env: {}, chdir: nil, timeout: 60)
    server = spawn_serve(app, *args, env: env, chdir: chdir)
    line = wait_for_line(server, /serving .* on (tcp:\S+)/, timeout: timeout)
    server[:port] = Integer(line[/tcp:\/\/127\.0\.0\.1:(\d+)/, 1])
    server
  end

  # #serve without waiting: for a server that is not meant to come up.
  # `bind: false` leaves out the `-b tcp://127.0.0.1:0` given otherwise.
  def spawn_serve(app, *args, env: {}, chdir: nil, bind: true)
    path = (chdir || app.start_with?("/")) ? app : File.join(FIXTURES, app)
    reader, writer = IO.pipe
    pid = Process.spawn(env, RbConfig.ruby, EXE, "serve", path, *(bind ? ["-b", "tcp://127.0.0.1:0"] : []), *args,
                        chdir: chdir || Dir.pwd, out: writer, err: writer, pgroup: true)
    writer.close
    server = { pid: pid, out: reader, lines: [] }
    (@servers ||= []) << server
    server
  end

  def wait_for_line(server, pattern, timeout: 60)
    Timeout.timeout(timeout) do
      loop do
        found = server[:lines].find { |l| l.match?(pattern) }
        return found if found

        line = server[:out].gets or raise "server exited; output:\n#{server[:lines].join}"
        server[:lines] << line
      end
    end
  rescue Timeout::Error
    flunk "no line matching #{pattern} within #{timeout} s; output:\n#{server[:lines].join}"
  end

  # Everything the server printed so far (server[:lines] plus what is
  # waiting in the pipe), as lines.
  def output_lines(server)
    pending = +""
    while (chunk = server[:out].read_nonblock(65_536, exception: false)).is_a?(String)
      pending << chunk
    end
    server[:lines].concat(pending.lines)
  end

  # What a failed #eventually adds: the last lines each server printed.
  def failure_context
    return super unless @servers&.any?

    @servers.map do |server|
      lines = server[:out].closed? ? server[:lines] : output_lines(server)
      "\n--- the server (pid #{server[:pid]}), last lines:\n#{lines.last(40).join}"
    end.join
  end

  def get(server, path = "/")
    Net::HTTP.start("127.0.0.1", server[:port], open_timeout: 5, read_timeout: 30) { |http| http.get(path) }
  end

  # [answering pid, pid that loaded the app]
  def pids(server, path = "/")
    response = get(server, path)
    assert_equal "200", response.code, response.body
    response.body.split.map { |pid| Integer(pid) }
  end

  def worker_pids(master)
    Dir.children("/proc").filter_map do |entry|
      next unless entry.match?(/\A\d+\z/)

      stat = File.read("/proc/#{entry}/stat") rescue next # rubocop:disable Style/RescueModifier -- it may have exited
      Integer(entry) if Integer(stat[/\) \S (\d+)/, 1]) == master
    end.sort
  end


  def wait_exit(server, timeout: 30)
    Timeout.timeout(timeout) { Process.wait2(server[:pid])[1] }
  end

  def kill_group(pid)
    Process.kill("KILL", -pid)
  rescue Errno::ESRCH, Errno::EPERM
    nil
  end

  # user + system CPU time of a process, seconds (Linux /proc).
  def cpu_seconds(pid)
    File.read("/proc/#{pid}/stat").split(") ", 2).last.split[11, 2].sum(&:to_i).fdiv(Etc.sysconf(Etc::SC_CLK_TCK))
  end

  def alive?(pid)
    Process.kill(0, pid)
    true
  rescue Errno::ESRCH
    false
  end
end
