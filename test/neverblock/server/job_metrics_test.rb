# frozen_string_literal: true

require_relative "../../test_helper"
require "neverblock/server"
require "neverblock/server/cluster/job_metrics"
require "json"

# The master's sum of the Solid Queue pools' counts (Cluster::JobMetrics):
# what the pools wrote, added up; a file it cannot add (another version's
# buckets, a torn or foreign file) is left out, and /metrics goes on.
class ServerJobMetricsTest < PlainTest
  JobCounts = NeverBlock::SolidQueue::JobCounts

  def setup
    @metrics = NeverBlock::Server::Cluster::JobMetrics.new
  end

  def teardown
    @metrics.close
  end

  def counts(succeeded:, running: 0)
    counts = JobCounts.new
    running.times { counts.started }
    succeeded.times do
      counts.started
      counts.ended(:succeeded, 0.2)
    end
    counts.to_h
  end

  def write(name, data)
    File.write(File.join(@metrics.directory, name), data.is_a?(String) ? data : JSON.generate(data))
  end

  def test_the_pools_counts_are_added_up
    write("#{Process.pid}-1.json", counts(succeeded: 2, running: 1))
    write("#{Process.pid}-2.json", counts(succeeded: 3))
    total = @metrics.read
    assert_equal [1, 5, 5], [total[:running], total[:succeeded], total[:duration][:count]]
  end

  def test_a_file_it_cannot_add_is_left_out
    write("#{Process.pid}-1.json", counts(succeeded: 2))
    other_buckets = counts(succeeded: 7)
    other_buckets[:duration][:counts] << 0 # another version's histogram
    write("#{Process.pid}-2.json", other_buckets)
    write("#{Process.pid}-3.json", counts(succeeded: 1).merge(failed: nil))
    write("#{Process.pid}-4.json", "{\"running\":")
    total = @metrics.read
    assert_equal 2, total[:succeeded]
  end

  def test_none_written_yet_is_nil
    assert_nil @metrics.read
  end
end
