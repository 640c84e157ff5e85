# frozen_string_literal: true

# The app of bench/faults.rb, for NeverBlock::Server and Puma alike:
#   GET /     "Hello world\n"
#   GET /die  kills the worker process that serves it (an app whose requests crash it)
HELLO = "Hello world\n"

run(lambda do |env|
  Process.kill(:KILL, Process.pid) if env["PATH_INFO"] == "/die"
  [200, { "content-type" => "text/plain", "content-length" => HELLO.bytesize.to_s }, [HELLO]]
end)
