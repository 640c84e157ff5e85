# frozen_string_literal: true

require_relative "../test_helper"
require "tmpdir"
require "stringio"
require "neverblock/rails_integration"

# RAILS_MAX_THREADS, unset, becomes 25 before a Rails app reads its
# database.yml; the line saying so appears only where that changes the pool.
class RailsMaxThreadsTest < PlainTest
  def setup
    super
    @saved = ENV.delete("RAILS_MAX_THREADS")
  end

  def teardown
    @saved ? ENV["RAILS_MAX_THREADS"] = @saved : ENV.delete("RAILS_MAX_THREADS")
    super
  end

  def test_a_generated_database_yml_that_reads_it_is_told
    assert_equal "RAILS_MAX_THREADS was not set: set to 25, so that a generated config/database.yml gives " \
                 "ActiveRecord a pool of 25 connections per process\n",
                 told(%(default: &default\n  adapter: sqlite3\n  max_connections: <%= ENV.fetch("RAILS_MAX_THREADS") { 3 } %>\n))
    assert_equal "25", ENV["RAILS_MAX_THREADS"]
  end

  def test_a_database_yml_with_its_own_pool_is_not_told_of_a_change_it_does_not_see
    assert_equal "", told("default: &default\n  adapter: sqlite3\n  pool: 5\n")
    assert_equal "25", ENV["RAILS_MAX_THREADS"], "set all the same (the app may read it elsewhere)"
  end

  def test_a_value_already_set_is_kept_silently
    ENV["RAILS_MAX_THREADS"] = "40"
    assert_equal "", told(%(pool: <%= ENV["RAILS_MAX_THREADS"] %>\n))
    assert_equal "40", ENV["RAILS_MAX_THREADS"]
  end

  private

  def told(database_yml)
    Dir.mktmpdir do |dir|
      Dir.mkdir(File.join(dir, "config"))
      File.write(File.join(dir, "config", "database.yml"), database_yml)
      out = StringIO.new
      Dir.chdir(dir) { NeverBlock::RailsIntegration.default_rails_max_threads(out) }
      out.string
    end
  end
end
