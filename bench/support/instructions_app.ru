# frozen_string_literal: true

# bench/instructions.rb's hello world. Under callgrind a request runs some
# 50 times slower than natively, long enough to hold its request slot past
# Connection::TURN (1 ms), which a native hello request (tens of µs) never
# does: its connection's next request would then wait its turn parked, a
# path the native server does not take. TURN is raised here so that the
# instructions counted are those of the native path (revisions before TURN
# have none to raise).
connection = NeverBlock::Server::Connection
if connection.const_defined?(:TURN, false)
  connection.send(:remove_const, :TURN)
  connection.const_set(:TURN, 3600.0)
end

# GET /gc: a full garbage collection, which bench/instructions.rb asks for
# before each counted stretch, so that the collections within it fall at the
# same requests in every run (a minor collection costs as many instructions
# as some hundred requests: where it falls would move the count by 1-4 %).
run lambda { |env|
  GC.start if env["PATH_INFO"] == "/gc"
  [200, { "content-type" => "text/plain" }, ["Hello, world!"]]
}
