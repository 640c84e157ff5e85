# frozen_string_literal: true

require "test_helper"
require_relative "../fixtures/child_ruby"
require "neverblock/server"
require "neverblock/postgres"

# NeverBlock with OpenTelemetry: test/fixtures/telemetry_cases.rb runs under
# the real SDK in a child Ruby (this process must not load OpenTelemetry:
# every task would carry a context from then on); here, what happens when
# spans are asked for and OpenTelemetry is not loaded.
class TelemetryTest < PlainTest
  include ChildRuby

  CASES = "test/fixtures/telemetry_cases.rb"

  def test_tasks_requests_and_queries_under_the_sdk
    out, err, status = ruby_child("-Itest", CASES, timeout: 120)
    assert status.success?, "#{out}\n#{err}"
    assert_match(/^9 runs, \d+ assertions, 0 failures, 0 errors, 0 skips$/, out)
  end

  def test_query_spans_without_opentelemetry_are_a_clear_error
    refute defined?(::OpenTelemetry::Trace), "this process must not have OpenTelemetry loaded"
    error = assert_raises(ArgumentError) { NeverBlock::Postgres.pool(opentelemetry: true, host: "127.0.0.1") }
    assert_match(/NeverBlock::Postgres\.pool: opentelemetry: true needs OpenTelemetry loaded first/, error.message)
  end

  def test_request_spans_without_opentelemetry_are_logged_once_and_requests_served
    log = StringIO.new
    logger = NeverBlock.logger
    NeverBlock.logger = Logger.new(log)
    server = NeverBlock::Server.new(->(_env) { [200, {}, ["ok"]] }, bind: ["tcp://127.0.0.1:0"], workers: 0, opentelemetry: true)
    port = Integer(server.bound_addresses.first[/\d+\z/])
    thread = Thread.new { server.run }
    codes = Array.new(3) { Net::HTTP.get_response(URI("http://127.0.0.1:#{port}/")).code }
    assert_equal %w[200 200 200], codes
    assert_equal 1, log.string.scan(/opentelemetry: true needs OpenTelemetry loaded first.*serving without request spans/).size, log.string
  ensure
    server&.stop
    thread&.join(20)
    NeverBlock.logger = logger
  end
end
