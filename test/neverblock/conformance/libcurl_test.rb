# frozen_string_literal: true

require_relative "conformance_helper"
require "typhoeus"

# libcurl (Typhoeus/Ethon here; curb is the same) waits inside C, where no
# scheduler hook can see it: a call holds the loop until it is done. The
# documented fix is to run the call on the loop's thread pool with
# NeverBlock.defer, which suspends only the calling fiber.
class ConformanceLibcurlTest < ConformanceTest
  def setup
    super
    @port = slow_http_server
  end

  def test_typhoeus_through_defer_runs_concurrently
    bodies = []
    duration = elapsed do
      on_scheduler_thread do
        10.times do |index|
          schedule { bodies << NeverBlock.defer { Typhoeus.get("http://127.0.0.1:#{@port}/#{index}", timeout: 10).body } }
        end
      end
    end
    assert_equal 10.times.map { |index| "/#{index}" }.sort, bodies.sort
    assert_operator duration, :<, 2.5, "ten 0.5 s Typhoeus calls through defer took #{duration.round(2)} s"
  end

  # Without defer two calls in two fibers run one after the other: what the
  # docs warn of (and the stall detector reports).
  def test_typhoeus_without_defer_holds_the_loop
    duration = elapsed do
      on_scheduler_thread { 2.times { |index| schedule { Typhoeus.get("http://127.0.0.1:#{@port}/#{index}", timeout: 10) } } }
    end
    assert_operator duration, :>=, 0.9, "two 0.5 s calls without defer ran at once: libcurl no longer blocks?"
  end
end
