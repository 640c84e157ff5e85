# frozen_string_literal: true

require "etc"

module NeverBlockBench
  # Keeps the CPUs from going idle while a block runs: one busy-looping
  # child process per CPU but one, at the lowest priority (nice 19), so it
  # takes CPU time only when nothing else wants it.
  #
  # Why: on a virtual machine, waking an idle virtual CPU (a halted vCPU,
  # woken by an inter-processor interrupt through the hypervisor) can take
  # tens of microseconds. A client that waits for every reply (one query at
  # a time on one connection) pays that twice per round trip when client
  # and server sit on different, otherwise idle CPUs; with the CPUs kept
  # busy it does not. Measured on the 2-vCPU Firecracker VM of
  # bench/results: pgbench -M prepared -c 1 does 10-14k tps idle and
  # 57-62k tps with a spinner.
  module Spinner
    module_function

    # @param count [Integer] spinners to run (default: CPUs - 1, at least 1)
    # @return [Object] the block's value
    def awake(count: [Etc.nprocessors - 1, 1].max)
      parent = Process.pid
      pids = Array.new(count) do
        fork do
          Process.setpriority(Process::PRIO_PROCESS, 0, 19)
          # Spins until killed, or until the parent is gone (killed itself,
          # say by a benchmark's timeout, before it could kill this).
          10_000.times {} while Process.ppid == parent # rubocop:disable Lint/EmptyBlock
          exit!(0)
        end
      end
      yield
    ensure
      pids&.each do |pid|
        Process.kill("KILL", pid)
        Process.wait(pid)
      rescue Errno::ESRCH, Errno::ECHILD
        nil
      end
    end
  end
end
