# frozen_string_literal: true

# For bench/balance.rb: GET / answers at once; GET /burn computes for 50 ms
# of CPU time (its thread's), as a request that renders a big page would.
BURN_SECONDS = 0.05

run(lambda do |env|
  if env["PATH_INFO"] == "/burn"
    deadline = Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) + BURN_SECONDS
    nil while Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) < deadline
  end
  [200, { "content-type" => "text/plain" }, ["ok\n"]]
end)
