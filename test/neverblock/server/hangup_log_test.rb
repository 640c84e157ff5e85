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

  # The storm goes on until three summaries were written, not for a fixed
  # time: a pause of the machine may delay a line, never hasten one. Lines
  # come at least a second apart (a pause of over a second between two
  # hang-ups rightly gives the next a line of its own again), and every
  # hang-up is in a line: its own, or a summary's count.
  def test_a_storm_that_goes_on_is_one_summary_line_a_second
    output = StringIO.new
    logger = Logger.new(output, formatter: ->(_severity, _time, _name, message) { "#{NeverBlock::Clock.now} #{message}\n" })
    summaries = -> { output.string.scan(/more requests were cancelled/).size }
    total = 0
    previous = NeverBlock.logger
    NeverBlock.logger = logger
    NeverBlock.run do # returns once the last summary is written
      hangups = NeverBlock::Server::HangupLog.new
      deadline = NeverBlock::Clock.now + 30
      while summaries.call < 3 && NeverBlock::Clock.now < deadline
        10.times { hangups.hung_up(ENV_OF, "while the app handled it") }
        total += 10
        NeverBlock.sleep(0.01)
      end
    end
    log = output.string
    lines = log.lines.map { |line| line.split(" ", 2) }
    own = lines.count { |_at, message| message.include?("GET /feed: the client hung up") }
    counts = lines.filter_map { |_at, message| message[/(\d+) more requests were cancelled in the last second/, 1]&.to_i }
    assert_operator counts.size, :>=, 3, log
    assert_match(%r{GET /feed: the client hung up while the app handled it}, lines.first.last)
    assert_equal total, own + counts.sum, "every hang-up is in a line of its own or a summary:\n#{log}"
    lines.map { |at, _message| Float(at) }.each_cons(2) do |earlier, later|
      assert_operator later - earlier, :>=, NeverBlock::Server::HangupLog::INTERVAL - 0.02, "lines a second apart:\n#{log}"
    end
  ensure
    NeverBlock.logger = previous
  end
end
