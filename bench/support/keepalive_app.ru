# frozen_string_literal: true

# For bench/keepalive.rb. Every response names the process that answered it
# (x-pid), so that the client can count each worker's share, and echoes the
# client's x-sent (when it wrote the request), so that it can time the response.
#   GET /cpu    computes for 20 ms of CPU time (its thread's)
#   GET /mixed  computes for 10 ms, then sleeps 10 ms: an IO wait, a fiber's
#               under NeverBlock and Falcon, a thread's under Puma
#   GET /ruby   the serving Ruby (PeerServers.check_ruby: is YJIT on in it?)
#   anything else answers at once
require_relative "ruby_description"

KEEPALIVE_COMPUTE = lambda do |seconds|
  deadline = Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) + seconds
  nil while Process.clock_gettime(Process::CLOCK_THREAD_CPUTIME_ID) < deadline
end

run(lambda do |env|
  body = "ok\n"
  case env["PATH_INFO"]
  when "/cpu" then KEEPALIVE_COMPUTE.call(0.02)
  when "/mixed"
    KEEPALIVE_COMPUTE.call(0.01)
    sleep 0.01
  when "/ruby" then body = NeverBlockBench.ruby_description
  end
  headers = { "content-type" => "text/plain", "x-pid" => Process.pid.to_s }
  headers["x-sent"] = env["HTTP_X_SENT"] if env["HTTP_X_SENT"]
  [200, headers, [body]]
end)
