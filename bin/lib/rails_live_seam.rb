# frozen_string_literal: true

# Loaded (-r) by bin/rails-live-suite before one of Rails' own Live test files,
# in its `loop` and `seam` modes: every test runs inside NeverBlock.run, with
# Active Support's isolation level :fiber (as NeverBlock::Server sets it). In
# `seam` mode (NB_LIVE_SEAM=1) NeverBlock's ActionController::Live seam is
# installed as the server installs it and is on for every Live action on the
# loop (Rails' tests have no server env); where a test sends its controller to
# a thread of its own (LiveStreamTest#setup), the seam takes it instead.
require "bundler/setup"
require "active_support"
require "minitest"
require "neverblock"
require "neverblock/server"

module RailsLiveSuite
  # The seam, on without NeverBlock::Server's env key; counts what it ran.
  module ForcedSeam
    private

    def served_on_the_loop?
      NeverBlock.neverblocking?
    end

    def process_action(*)
      RailsLiveSuite.ran += 1 if @_neverblock_live&.fiber.equal?(Fiber.current)
      super
    end
  end

  # LiveStreamTest#setup gives its controller a new_controller_thread of its
  # own (7.2: Thread.new; 8.x: Rails' executor): the seam's instead.
  module SeamForTheTestsController
    def after_setup
      super
      controller = instance_variable_get(:@controller)
      return unless controller.is_a?(ActionController::Live) && controller.singleton_methods.include?(:new_controller_thread)

      controller.singleton_class.send(:remove_method, :new_controller_thread)
      controller.define_singleton_method(:new_controller_thread) do |&block|
        NeverBlock::RailsIntegration::Live.instance_method(:new_controller_thread).bind_call(self, &block)
      end
    end
  end

  # Each test with its setup and teardown inside a NeverBlock loop.
  module InALoop
    def run
      NeverBlock.run { super }
    end
  end

  class << self
    attr_accessor :ran
  end
  self.ran = 0
end

ActiveSupport::IsolatedExecutionState.isolation_level = :fiber
Minitest::Test.prepend(RailsLiveSuite::InALoop)
if ENV["NB_LIVE_SEAM"] == "1"
  Minitest::Test.prepend(RailsLiveSuite::SeamForTheTestsController)
  NeverBlock::RailsIntegration.run_live_actions_on_the_loop
  ActiveSupport.on_load(:action_controller) { ActionController::Live.prepend(RailsLiveSuite::ForcedSeam) }
  at_exit { $stderr.puts "Live actions run by NeverBlock's seam, as tasks of the test's loop: #{RailsLiveSuite.ran}" }
end
