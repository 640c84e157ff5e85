# frozen_string_literal: true

# The bench/streams apps' own view of their streams: each stream's worst gap
# between two of its events as the app hands them to the server (or, relayed,
# as it reads them from the upstream), measured in the server's process. The
# client measures the same gap where the events arrive, which adds its own
# turns: two forked processes reading thousands of streams each. GET
# /stream-gaps answers "p99 max count" in ms and forgets them.
module StreamGaps
  @worst = []
  @lock = Mutex.new # Falcon and Puma run streams in threads too

  module_function

  # Calls the block with a callable to call at each event, and records the
  # stream's worst gap between two calls once the block returns.
  def record
    last = nil
    worst = 0.0
    tick = lambda do
      now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
      worst = now - last if last && now - last > worst
      last = now
    end
    yield tick
  ensure
    @lock.synchronize { @worst << worst } if last
  end

  # @return [String] "p99 max count" of the worst gaps recorded since the last call, in ms
  def report
    gaps = @lock.synchronize { @worst.slice!(0..) }.sort
    return "- - 0" if gaps.empty?

    format("%d %d %d", gaps[((gaps.size * 0.99).ceil - 1)] * 1000, gaps.last * 1000, gaps.size)
  end
end
