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

run ->(_env) { [200, { "content-type" => "text/plain" }, ["Hello, world!"]] }
