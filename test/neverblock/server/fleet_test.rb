# frozen_string_literal: true

require_relative "../../test_helper"
require_relative "../../../bench/support/fleet"
require "net/http"
require "socket"

# A small fleet drill (bench/run fleet is the whole one): three hosts in network namespaces, each
# `neverblock serve -w 2`, behind HAProxy. A rolling hot restart (HUP) host by host under light
# keep-alive load loses no request, long requests finish on the host they started on, event
# streams come whole (every event, then the last chunk) and those of a host being deployed
# reconnect to another host; and one herd across the three hosts costs one upstream call through a
# RedisStore; a RedisSemaphore shared by the three hosts bounds their calls at the upstream. Runs on
# bin/test's chroots too (they have iproute2, haproxy and redis-server, and let
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
    context = "#{drill.inspect}\nlogs:\n#{fleet.hosts.map { |host| fleet.tail(host) }.join}" \
              "HAProxy's requests that did not end well:\n#{fleet.haproxy_failures}"

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

  # A RedisSemaphore of 3 shared by the three hosts (six workers): the upstream, which counts,
  # never serves more than 3 of their calls at once; holders killed with SIGKILL on every host
  # give their permits back when their leases end (2 s), and the fleet calls the upstream again.
  def test_a_redis_semaphore_bounds_three_hosts_at_their_upstream_and_killed_holders_permits_come_back
    fleet = NeverBlockFleet::Fleet.new(upstream_delay: 0.2)
    begin
      fleet.start
    rescue NeverBlockFleet::Unavailable => e
      skip "no fleet here: #{e.message}"
    end
    context = -> { "logs:\n#{fleet.hosts.map { |host| fleet.tail(host) }.join}" }

    fleet.upstream_most # resets it
    answers = fleet_requests(fleet, Array.new(36) { "/limited" })
    assert_equal ["200"] * 36, answers, context.call
    most = fleet.upstream_most
    assert_operator most, :<=, 3, "the upstream served more calls at once than the limit"
    assert_operator most, :>=, 2, "the calls were serialized"
    assert_equal 36, fleet.upstream_calls

    holds = fleet.hosts.map { |host| hold(fleet, host) }
    holders = holds.map { |socket, line| [line.split.first, Integer(line.split.last)] }
    assert_equal fleet.hosts, holders.map(&:first)
    assert_equal ["503"], fleet_requests(fleet, ["/limited?0.5"]), "a fourth holder while three hold"

    holders.each { |_host, pid| Process.kill(:KILL, pid) }
    answers = fleet_requests(fleet, Array.new(9) { "/limited" })
    assert_equal ["200"] * 9, answers, context.call
    assert_operator fleet.upstream_most, :<=, 3
  ensure
    holds&.each { |socket, _line| socket.close }
    fleet&.stop
  end

  private

  # The paths requested at once through HAProxy. @return [Array<String>] the status codes
  def fleet_requests(fleet, paths)
    paths.map do |path|
      Thread.new do
        Net::HTTP.start("127.0.0.1", fleet.port, read_timeout: 60) { |http| http.get(path).code }
      rescue StandardError => e
        e.class.name
      end
    end.map(&:value)
  end

  # GET /hold on `host`, straight to it. @return [Array(TCPSocket, String)] the open connection and
  # the first line of the body ("host1 PID")
  def hold(fleet, host)
    socket = TCPSocket.new(fleet.address(host), NeverBlockFleet::PORT)
    socket.write("GET /hold HTTP/1.1\r\nhost: fleet\r\n\r\n")
    socket.gets("\r\n\r\n") # the head
    loop do # past the chunk sizes
      line = socket.gets or flunk "#{host}: /hold ended before it held a permit"
      return [socket, line] if line.start_with?(host)
    end
  end
end
