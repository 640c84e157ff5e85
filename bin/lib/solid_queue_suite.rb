# frozen_string_literal: true

# Loaded (-r) by bin/solid-queue-suite before one of Solid Queue's own test
# files, in both modes: a Minitest reporter prints each test's result after
# the run ("solid-queue-suite: Class#test_name ."), one line each, where the
# verbose progress lines would be split by what the tests log.
#
# In the `neverblock` mode (SOLID_QUEUE_SUITE_MODE=neverblock), NeverBlock is
# loaded as a Rails app's Gemfile loads it: after Rails and before the app
# boots, so NeverBlock::Railtie is in place when Solid Queue's dummy app
# initializes. The Railtie sets Active Support's isolation level to :fiber
# and, once Solid Queue loads, requires neverblock/solid_queue, whose seam has
# SolidQueue::Pool.build make NeverBlock's pool for `fibers:` workers and
# drops Solid Queue's check for the `async` gem. Solid Queue's FiberPoolTest
# builds its pool by class name (SolidQueue::FiberPool.new), not through
# Pool.build: in the test process that name is NeverBlock's pool, so the
# pool's own tests run against it too. Nothing of Solid Queue's tests is
# changed.
require "bundler/setup"
require "minitest"

module SolidQueueSuite
  # The test process, not Solid Queue's forks of it (supervisors, workers).
  PID = Process.pid

  # Prints every result once the run is over.
  class Results < Minitest::AbstractReporter
    def initialize
      super
      @results = []
    end

    def record(result)
      @results << "#{result.klass}##{result.name} #{result.result_code}"
    end

    def report
      $stdout.puts # after the progress dots
      @results.each { |line| $stdout.puts "solid-queue-suite: #{line}" }
    end
  end

  # Points the name Solid Queue's tests build pools by at NeverBlock's pool.
  # @return [void]
  def self.point_fiber_pool_at_neverblock
    ::SolidQueue.send(:remove_const, :FiberPool) if ::SolidQueue.const_defined?(:FiberPool, false)
    ::SolidQueue.const_set(:FiberPool, ::NeverBlock::SolidQueue::FiberPool)
  end

  # What NeverBlock's pools in the test process ran, and whether `async`
  # was loaded (it should not be: NeverBlock's pool does not use it).
  # @return [String]
  def self.summary
    stats = ::NeverBlock::SolidQueue.stats
    "NeverBlock fiber pools in the test process: #{::NeverBlock::SolidQueue::FiberPool.all.size}, " \
      "jobs run #{stats[:succeeded] + stats[:failed] + stats[:cancelled]} " \
      "(succeeded #{stats[:succeeded]}, failed #{stats[:failed]}, cancelled #{stats[:cancelled]}); " \
      "async loaded: #{defined?(::Async::Reactor) ? "yes" : "no"}"
  end
end

module Minitest
  def self.plugin_solid_queue_suite_init(_options)
    reporter << SolidQueueSuite::Results.new
  end
end
Minitest.extensions << "solid_queue_suite"

if ENV["SOLID_QUEUE_SUITE_MODE"] == "neverblock"
  require "rails"
  require "neverblock" # with Rails loaded: NeverBlock::Railtie

  # After the Railtie's own :solid_queue hook (registered first), which has
  # installed the seam.
  ActiveSupport.on_load(:solid_queue) do
    raise "NeverBlock's Solid Queue seam is not installed" unless defined?(NeverBlock::SolidQueue::Seam)

    SolidQueueSuite.point_fiber_pool_at_neverblock
  end
  at_exit { $stderr.puts SolidQueueSuite.summary if Process.pid == SolidQueueSuite::PID && defined?(NeverBlock::SolidQueue) }
end
