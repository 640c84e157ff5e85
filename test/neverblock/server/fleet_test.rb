# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../../bench/support/fleet"

# A small fleet drill (bench/run fleet is the whole one): three hosts in network namespaces, each
# `neverblock serve -w 2`, behind HAProxy. A rolling hot restart (HUP) host by host under light
# keep-alive load loses no request, long requests finish on the host they started on, event
# streams end with their last chunk; and one herd across the three hosts costs one upstream call
# through a RedisStore. Skips where namespaces cannot be made (not root, bin/test's chroots) or
# haproxy or redis-server is missing.
class ServerFleetTest < PlainTest
  def setup
    super
    NeverBlockFleet.check!
  rescue NeverBlockFleet::Unavailable => e
    skip "no fleet here: #{e.message}"
  end

  def test_a_rolling_hot_restart_behind_haproxy_loses_nothing_and_a_herd_costs_one_upstream_call
    # Names and addresses of this process's own: two suites may run at once on one machine.
    fleet = NeverBlockFleet::Fleet.new(prefix: "nbt#{Process.pid % 100_000}", subnet: "10.78.#{Process.pid % 250}", upstream_delay: 0.5)
    begin
      fleet.start
    rescue NeverBlockFleet::Unavailable => e
      skip "no fleet here: #{e.message}"
    end
    drill = NeverBlockFleet.drill(fleet, variant: "hup", clients: 4, pause: 0.01, long: 1, slow: 2, streams: 2,
                                         stream_seconds: 3, drain: 1)
    context = "#{drill.inspect}\nlogs:\n#{fleet.hosts.map { |host| fleet.tail(host) }.join}"

    assert_operator drill[:requests], :>, 100, context
    assert_equal 0, drill[:lost], context
    assert_equal drill[:long], drill[:long_finished], context
    assert_equal 0, drill[:cut], context
    assert_operator drill[:clean], :>=, 2, context

    herd = NeverBlockFleet.herd(fleet, 50)
    assert_equal 50, herd[:answered], herd.inspect
    assert_equal 1, herd[:calls], herd.inspect
  ensure
    fleet&.stop
  end
end
