# frozen_string_literal: true

require "etc"

module NeverBlockBench
  # CPU time a server spent, read from /proc: user + system time of every
  # process in its session (a {ServerProcess} is a session leader, so this
  # counts the workers Falcon or Puma fork, and all their threads), plus
  # what its reaped children left in the leader's cutime/cstime.
  #
  #   before = ProcessCpu.session_seconds(server.pid)
  #   ... load it ...
  #   cpu = ProcessCpu.session_seconds(server.pid) - before   # seconds of CPU
  #
  # Per request, this is the number that stays put on a shared machine: the
  # kernel charges a process only for the time it ran, whoever else ran
  # meanwhile, where requests/s moves with every other process's load.
  # Resolution is one clock tick (10 ms at USER_HZ 100): measure seconds.
  module ProcessCpu
    # Clock ticks per second of /proc/<pid>/stat's times.
    TICKS = Etc.sysconf(Etc::SC_CLK_TCK)

    module_function

    # @param session [Integer] a session id (the leader's pid)
    # @return [Float] CPU seconds (user + system) of the session's processes
    #   so far; processes that already exited count only when reaped by a
    #   process still in the session (their leader's cutime/cstime)
    def session_seconds(session)
      ticks = Dir.glob("/proc/[0-9]*/stat").sum do |path|
        fields = stat_fields(path)
        next 0 unless fields && Integer(fields[3]) == session # field 6, session

        # fields 14-17: utime, stime, cutime, cstime
        fields[11, 4].sum { |value| Integer(value) }
      end
      ticks.to_f / TICKS
    end

    # The fields of a /proc/<pid>/stat after "pid (comm)", which may hold
    # spaces and parentheses: the state is fields[0], the session fields[3].
    # @return [Array<String>, nil] nil when the process is gone
    def stat_fields(path)
      text = File.read(path)
      text[(text.rindex(")") + 2)..].split(" ")
    rescue SystemCallError
      nil
    end
  end
end
