# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"

# One line per hang-up, but a storm of them (a proxy dropping its upstream
# connections) becomes one summary line a second.
class ServerHangupLogTest < PlainTest
  ENV_OF = { "REQUEST_METHOD" => "GET", "PATH_INFO" => "/feed" }.freeze

  def test_a_hang_up_gets_one_line_without_a_backtrace
    log = capture_log do
      NeverBlock.run { NeverBlock::Server::HangupLog.new.hung_up(ENV_OF, "during its streamed response") }
    end
    assert_equal 1, log.lines.size, log
    assert_includes log, "INFO -- : NeverBlock::Server: GET /feed: the client hung up during its streamed response; " \
                         "the request was cancelled (pid #{Process.pid})\n"
  end

  def test_a_thousand_at_once_are_one_line_then_one_summary
    log = capture_log do
      NeverBlock.run do # returns once the summary is written
        hangups = NeverBlock::Server::HangupLog.new
        1000.times { hangups.hung_up(ENV_OF, "while the app handled it") }
      end
    end
    lines = log.lines
    assert_equal 2, lines.size, log
    assert_match(%r{GET /feed: the client hung up while the app handled it}, lines.first)
    assert_match(/999 more requests were cancelled in the last second because their client hung up/, lines.last)
  end

  def test_a_storm_that_goes_on_is_one_summary_line_a_second
    log = capture_log do
      NeverBlock.run do
        hangups = NeverBlock::Server::HangupLog.new
        deadline = NeverBlock::Clock.now + 2.5
        while NeverBlock::Clock.now < deadline
          10.times { hangups.hung_up(ENV_OF, "while the app handled it") }
          NeverBlock.sleep(0.01)
        end
      end
    end
    # One line of its own, then one summary a second (2.5 s: two or three of them).
    assert_equal 1, log.lines.grep(%r{GET /feed}).size, log
    assert_includes 2..3, log.lines.grep(/more requests were cancelled/).size, log
  end
end
