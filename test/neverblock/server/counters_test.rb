# frozen_string_literal: true

require_relative "../../test_helper"
require "json"
require "neverblock/server"

# The master's Counters: per worker index, what every process that held it
# counted, so that a counter only grows while the processes come and go.
class ServerCountersTest < PlainTest
  Counters = NeverBlock::Server::Cluster::Counters

  def test_a_new_process_at_an_index_adds_to_what_its_predecessor_counted
    counters = Counters.new
    counters.metrics(0, 100, snapshot(requests: { "GET 2xx" => 3 }, stalls: 1))
    counters.metrics(0, 100, snapshot(requests: { "GET 2xx" => 5 }, stalls: 1))
    counters.forget(100)
    counters.metrics(0, 200, snapshot(requests: { "GET 2xx" => 2, "POST 5xx" => 1 }, stalls: 0))
    totals = counters.totals(0)
    assert_equal({ "GET 2xx" => 7, "POST 5xx" => 1 }, totals["requests"])
    assert_equal 1, totals["stalls"]
  end

  def test_histograms_add_up_bucket_by_bucket
    counters = Counters.new
    counters.metrics(1, 100, snapshot(duration: [[2, 1], 0.5, 3]))
    counters.metrics(1, 200, snapshot(duration: [[1, 0], 0.25, 1]))
    histogram = counters.totals(1)["request_duration"]
    assert_equal [3, 1], histogram["counts"].first(2)
    assert_equal 0.75, histogram["sum"]
    assert_equal 4, histogram["count"]
  end

  def test_a_pool_that_vanishes_from_a_report_and_comes_back_is_not_counted_twice
    counters = Counters.new
    counters.metrics(0, 100, snapshot(pools: [{ "name" => "primary", "timeouts" => 2, "cancels" => 1 }]))
    counters.metrics(0, 100, snapshot(pools: [])) # no connections open for a moment: not in the report
    counters.metrics(0, 100, snapshot(pools: [{ "name" => "primary", "timeouts" => 3, "cancels" => 1 }]))
    assert_equal({ "primary" => { "timeouts" => 3, "cancels" => 1 } }, counters.totals(0)["database_pools"])
  end

  def test_a_count_lower_than_before_counts_again_from_zero
    counters = Counters.new
    counters.beat(0, 100, 10)
    counters.beat(0, 100, 4)
    assert_equal 14, counters.requests_started
  end

  def test_the_cluster_totals_add_up_every_index_and_survive_a_hot_restart
    counters = Counters.new
    counters.beat(0, 100, 10)
    counters.beat(1, 101, 7)
    counters.metrics(0, 100, snapshot(requests: { "GET 2xx" => 10 }))
    counters.metrics(1, 101, snapshot(requests: { "GET 2xx" => 6, "GET 4xx" => 1 }))
    carried = Counters.new(JSON.parse(JSON.generate(counters.carried)))
    assert_equal 17, carried.requests_started
    assert_equal({ "GET 2xx" => 16, "GET 4xx" => 1 }, carried.totals["requests"])
    assert_equal [0, 1], carried.indexes
    carried.beat(0, 300, 1)
    assert_equal 18, carried.requests_started
  end

  private

  # A {Metrics#snapshot} as the master parses it; duration: [counts, sum, count].
  def snapshot(requests: {}, stalls: 0, duration: [[0], 0.0, 0], pools: [])
    counts, sum, count = duration
    { "requests" => requests, "stalls" => stalls, "requests_timed_out" => 0, "requests_hung_up" => 0,
      "request_duration" => { "counts" => counts, "sum" => sum, "count" => count }, "database_pools" => pools,
      "connections" => 3 }
  end
end
