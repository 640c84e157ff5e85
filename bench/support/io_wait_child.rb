# frozen_string_literal: true

# One cell of bench/io_wait.rb, in a process of its own:
#   ruby io_wait_child.rb RUNTIME TIMEOUT WAITS PAIRS
# RUNTIME: neverblock (the NeverBlock on $LOAD_PATH) or async; TIMEOUT:
# seconds each wait is given, "none" for none. PAIRS tasks each write a
# byte into a socket pair, wait until its other end is readable and read
# the byte, WAITS over them all, after as many again unmeasured. Prints
# "CPU µs per wait, objects allocated per wait".
require "socket"

runtime, timeout, waits, pairs = ARGV
timeout = timeout == "none" ? nil : Float(timeout)
waits = Integer(waits)
pairs = Integer(pairs)

# Each of the `pairs` tasks' share of `count` waits, in `spawn`'s tasks under `run`.
ping_pong = lambda do |count, run, spawn, join|
  run.call do
    sockets = Array.new(pairs) { UNIXSocket.pair }
    tasks = sockets.map do |a, b|
      spawn.call do
        (count / pairs).times do
          b.write_nonblock("x")
          a.wait_readable(timeout) or raise "a wait timed out"
          a.read_nonblock(16)
        end
      end
    end
    join.call(tasks)
    sockets.flatten.each(&:close)
  end
end

case runtime
when "neverblock"
  require "neverblock"
  run = ->(&block) { NeverBlock.run(stall_threshold: nil, &block) }
  spawn = ->(&block) { NeverBlock.spawn(&block) }
  join = ->(tasks) { NeverBlock.wait_all(tasks) }
when "async"
  require "async"
  run = ->(&block) { Async(&block).wait }
  spawn = ->(&block) { Async(&block) }
  join = ->(tasks) { tasks.each(&:wait) }
else abort "unknown runtime #{runtime}"
end

ping_pong.call(waits, run, spawn, join) # warm-up (and YJIT's compiling)
GC.start
allocated = GC.stat(:total_allocated_objects)
cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
ping_pong.call(waits, run, spawn, join)
cpu = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) - cpu
puts format("%.4f %.3f", cpu * 1e6 / waits, (GC.stat(:total_allocated_objects) - allocated).fdiv(waits))
