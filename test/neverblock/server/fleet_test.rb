# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../../bench/support/fleet"

# A small fleet drill (bench/run fleet is the whole one): three hosts in network namespaces, each
# `neverblock serve -w 2`, behind HAProxy. A rolling hot restart (HUP) host by host under light
# keep-alive load loses no request, long requests finish on the host they started on, event
# streams come whole (every event, then the last chunk) and those of a host being deployed
# reconnect to another host; and one herd across the three hosts costs one upstream call through a
# RedisStore. Runs on bin/test's chroots too (they have iproute2, haproxy and redis-server, and let
# `ip netns exec` remount /sys); skips where it cannot (not root, no such command, `ip netns`
# refused, e.g. in a container without CAP_SYS_ADMIN), saying why.
class ServerFleetTest < PlainTest
  def setup
    super
    NeverBlockFleet.check!
  rescue NeverBlockFleet::Unavailable => e
    skip "no fleet here: #{e.message}"
  end

  def test_a_rolling_hot_restart_behind_haproxy_loses_nothing_and_a_herd_costs_one_upstream_call
    # Names and addresses of its own (a slot, NeverBlockFleet.claim_slot): passes may run at once on one machine.
    fleet = NeverBlockFleet::Fleet.new(upstream_delay: 0.5)
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
    # One stream pinned to each host just before its deploy, and any other that was there: each ends
    # while its host is out of the balancer, so its client's next stream comes from another host (a
    # reconnect that a starved client began only after the host was back in may land on it).
    assert_empty drill[:stayed], context
    assert_operator drill[:moved], :>=, 2, context

    herd = NeverBlockFleet.herd(fleet, 50)
    assert_equal 50, herd[:answered], herd.inspect
    assert_equal 1, herd[:calls], herd.inspect
  ensure
    fleet&.stop
  end
end
