# frozen_string_literal: true

require_relative "server_helper"
require "action_controller"
require "action_dispatch/middleware/cookies" # Live commits its cookie jar

# An ActionController::Live action streams from a thread of Rails' own;
# the server writes its body. A client that hangs up while the action
# waits between two writes is seen within about a second: the writing of
# the body is cancelled and the body closed, which Rails turns into
# ActionController::Live::ClientDisconnected at the action's next write;
# the request is logged 499 and counted as hung up.
class ServerLiveStreamTest < PlainTest
  include ServerHelper

  class EventsController < ActionController::Metal
    include ActionController::Live

    class << self
      # @return [Thread::Queue] what the test hears from the action.
      attr_accessor :events
      # @return [Thread::Queue] the action waits on it between its writes.
      attr_accessor :gate
    end

    def index
      response.headers["content-type"] = "text/event-stream"
      response.stream.write("data: first\n\n")
      self.class.gate.pop # a minute between events, for the client
      response.stream.write("data: second\n\n")
      self.class.events << :wrote_on
    rescue ActionController::Live::ClientDisconnected
      self.class.events << :client_disconnected
    ensure
      response.stream.close
    end
  end

  def setup
    @logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(@log = StringIO.new)
    EventsController.events = @events = Thread::Queue.new
    EventsController.gate = @gate = Thread::Queue.new
  end

  def teardown
    @gate << :go # the action's thread is Rails', not the server's: let it end
    super
  ensure
    NeverBlock.logger = @logger
  end

  def test_a_client_that_hangs_up_between_two_events_is_seen_and_the_action_told_at_its_next_write
    start_server(EventsController.action(:index), lint: false, access_log: access = StringIO.new)
    socket = connect
    socket.write(get("/events"))
    seen = +""
    Timeout.timeout(10) { seen << socket.readpartial(4096) until seen.include?("data: first") }
    socket.close
    eventually { access.string.include?('"GET /events HTTP/1.1" 499') }
    assert_equal 1, @server.stats[:requests_hung_up]
    @gate << :go
    assert_equal :client_disconnected, Timeout.timeout(10) { @events.pop }
  end
end
