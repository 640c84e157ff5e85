# frozen_string_literal: true

require_relative "server_helper"
require_relative "../../support/read_log"

# After a response, a keep-alive connection waits for its client's next
# request before it reads: a client that sends one request at a time (a
# browser, a proxy, wrk) cannot have sent it yet, and a read then finds
# nothing, a system call per request for no bytes. A client that pipelines
# (sent a request behind another) has its connection read ahead again, as
# its next request may be there already.
class ServerReadAheadTest < PlainTest
  include ServerHelper

  def setup
    super
    start_server
  end

  def test_a_client_that_sends_one_request_at_a_time_gets_no_read_that_finds_nothing
    socket = connect
    socket.write(get)
    assert_equal 200, read_response(socket).first
    log = read_log_of(socket)
    3.times do
      socket.write(get)
      assert_equal 200, read_response(socket).first
      sleep 0.05 # the server is back waiting for the next request
    end
    sleep 0.2
    assert_equal %i[bytes bytes bytes], log.read_log.map(&:last), "each read found a request; none was tried before it came"
  end

  # (A request that held its slot for Connection::TURN or longer has its
  # connection wait its turn instead, read ahead or not: on a loaded
  # machine a hello world may, so TURN is raised here.)
  def test_a_pipelining_client_has_its_connection_read_ahead
    with_constant(NeverBlock::Server::Connection, :TURN, 3600.0) do
      socket = connect
      socket.write(get * 2)
      2.times { assert_equal 200, read_response(socket).first }
      log = read_log_of(socket)
      socket.write(get)
      assert_equal 200, read_response(socket).first
      deadline = NeverBlock::Clock.now + 5
      sleep 0.01 until log.read_log.map(&:last).include?(:wait_readable) || NeverBlock::Clock.now > deadline
      assert_equal %i[bytes wait_readable], log.read_log.first(2).map(&:last), "after the answer, a read ahead that found nothing yet"
    end
  end

  private

  # The server's socket of the connection `client` opened, its reads logged from now on.
  def read_log_of(client)
    ReadLog.on(server_connection(client).instance_variable_get(:@socket))
  end
end
