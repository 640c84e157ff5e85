# frozen_string_literal: true

require "net/http"
require "timeout"
require_relative "free_port"

# A server started as a real child process (its own process group), its
# output collected, waited for on a port, stopped by a signal. Include it in
# a test class; `teardown` kills what is still running.
module ServerProcess
  include FreePort

  def teardown
    kill_server_process
    super
  end

  # Spawns `command` (stdout and stderr into #output) in a new process group.
  # @return [Integer] the pid.
  def start(*command, chdir: Dir.pwd, env: {})
    @out, writer = IO.pipe
    @pid = Process.spawn(env, *command, chdir: chdir, out: writer, err: writer, pgroup: true)
    writer.close
    @output = +""
    @reader = Thread.new do
      while (chunk = @out.readpartial(4096))
        @output << chunk
      end
    rescue EOFError, IOError
      nil
    end
    @pid
  end

  # What the process wrote so far.
  # @return [String]
  def output
    @output.dup
  end

  # GETs `path` on 127.0.0.1:`port` until the server answers.
  # @return [Net::HTTPResponse]
  def wait_for_answer(port, path = "/", timeout: 60)
    deadline = now + timeout
    begin
      Net::HTTP.start("127.0.0.1", port, open_timeout: 2, read_timeout: 10) { |http| http.get(path) }
    rescue SystemCallError, Net::OpenTimeout, EOFError
      flunk "no answer on port #{port} within #{timeout} s; output:\n#{@output}" if now > deadline
      sleep 0.2
      retry
    end
  end

  # Sends `signal` to the process and waits (30 s at most) for it to end.
  # @return [Process::Status]
  def stop_and_wait(signal = "INT")
    Process.kill(signal, @pid)
    status = Timeout.timeout(30) { Process.wait2(@pid)[1] }
    @pid = nil
    @reader.join(5)
    status
  end

  # Kills the process group of a server still running.
  def kill_server_process
    if @pid
      begin
        Process.kill("KILL", -@pid)
      rescue Errno::ESRCH
        nil
      end
      begin
        Process.wait(@pid)
      rescue Errno::ECHILD
        nil
      end
      @pid = nil
    end
    @out&.close
  end
end
