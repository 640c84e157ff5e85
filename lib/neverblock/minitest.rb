# frozen_string_literal: true

require "minitest"
require_relative "testing"

module NeverBlock
  # Minitest support: include it in a test class and every test (with its
  # setup and teardown) runs inside {NeverBlock.run}, with a per-test timeout
  # (default 10 s) that prints the backtraces of all live fibers when it
  # fires, and fails a test that leaves tasks running or descriptors open.
  #
  #   require "neverblock/minitest"
  #
  #   class FetchTest < Minitest::Test
  #     include NeverBlock::Minitest
  #     neverblock_timeout 30                   # this class's default
  #     neverblock_timeout 60, :test_slow_path  # one test
  #
  #     def test_slow_path
  #       assert_equal 2, NeverBlock.map([1, 2]) { |x| x }.size
  #     end
  #   end
  module Minitest
    # Class-level settings.
    module ClassMethods
      # Sets the timeout (seconds) for the named tests, or with no names for
      # every test of the class (and its subclasses).
      # @param seconds [Numeric]
      # @param tests [Array<Symbol, String>]
      # @return [void]
      def neverblock_timeout(seconds, *tests)
        NeverBlock.validate_timeout!(seconds, :seconds)
        if tests.empty?
          @neverblock_timeout = seconds
        else
          tests.each { |name| neverblock_timeouts[name.to_s] = seconds }
        end
      end

      # @return [Numeric] the timeout for `test`.
      # @api private
      def neverblock_timeout_for(test)
        neverblock_timeouts.fetch(test.to_s) do
          if instance_variable_defined?(:@neverblock_timeout)
            @neverblock_timeout
          elsif superclass.respond_to?(:neverblock_timeout_for)
            superclass.neverblock_timeout_for(test)
          else
            Testing.default_timeout
          end
        end
      end

      private

      def neverblock_timeouts
        @neverblock_timeouts ||= {}
      end
    end

    # @api private
    def self.included(base)
      base.extend(ClassMethods)
    end

    # Minitest's per-test entry point, wrapped in an event loop.
    # @return [Minitest::Result]
    def run
      result = nil
      Testing.run(timeout: self.class.neverblock_timeout_for(name), label: "#{self.class}##{name}") do
        result = super
      end
      result
    rescue Testing::Failure => e
      if e.is_a?(Testing::TimeoutFailure)
        # The test body saw the timeout as a Cancelled error; the timeout
        # report (with every fiber's backtrace) is the one worth reading.
        failures.reject! { |f| f.respond_to?(:error) && f.error.is_a?(NeverBlock::Cancelled) }
      end
      failure = ::Minitest::Assertion.new(e.message)
      failure.set_backtrace(e.backtrace)
      failures << failure
      ::Minitest::Result.from(self)
    end
  end
end
