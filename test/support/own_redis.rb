# frozen_string_literal: true

require "fileutils"

# A redis-server of a test's own, on a unix socket in a directory of its own
# (no TCP port, nothing saved), for tests that kill it and start it again
# (Redis gone, or back without its data). Include it, or call its functions
# on the module.
module OwnRedis
  module_function

  # @return [Integer] the server's pid; it may not answer yet.
  def spawn_redis(dir, socket)
    Process.spawn("redis-server", "--port", "0", "--unixsocket", socket, "--save", "", "--appendonly", "no",
                  "--dir", dir, out: File::NULL, err: File::NULL)
  end

  # Kills the server (when `pid` is one) and waits for it, then removes
  # `dir` (when given).
  # @return [void]
  def stop_redis(pid, dir = nil)
    if pid
      Process.kill(:KILL, pid)
      Process.wait(pid)
    end
    FileUtils.rm_rf(dir) if dir
  end

  # @return [Boolean] whether redis-server is on PATH.
  def redis_server?
    system("command -v redis-server >/dev/null")
  end
end
