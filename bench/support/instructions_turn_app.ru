# frozen_string_literal: true

# bench/instructions.rb's hello world for `--app turn`: every request holds
# its slot past Connection::TURN (set to 0 here), so the connection's next
# request waits its turn (parked in the server's IdleSet until its bytes
# come, behind those that came first): the path a native request takes when
# it holds its slot for 1 ms or more, as a Rails request does. The
# instructions counted are that path's (revisions before TURN have no such
# path).
connection = NeverBlock::Server::Connection
if connection.const_defined?(:TURN, false)
  connection.send(:remove_const, :TURN)
  connection.const_set(:TURN, 0.0)
end

# GET /gc: a full garbage collection, which bench/instructions.rb asks for
# before each counted stretch, so that the collections within it fall at the
# same requests in every run (a minor collection costs as many instructions
# as some hundred requests: where it falls would move the count by 1-4 %).
run lambda { |env|
  GC.start if env["PATH_INFO"] == "/gc"
  [200, { "content-type" => "text/plain" }, ["Hello, world!"]]
}
