# frozen_string_literal: true

require "rspec/core"
require_relative "testing"

module NeverBlock
  # RSpec support. Requiring it makes every example (with its `before` and
  # `after` hooks) run inside {NeverBlock.run}, with a per-example timeout
  # (default 10 s, or the `timeout:` metadata) that prints the backtraces of
  # all live fibers when it fires, and fails an example that leaves tasks
  # running or descriptors open. Opt an example or group out with
  # `neverblock: false`.
  #
  #   require "neverblock/rspec"
  #
  #   RSpec.describe "fetching" do
  #     it "is concurrent", timeout: 30 do
  #       expect(NeverBlock.map([1, 2]) { |x| x * 2 }).to eq [2, 4]
  #     end
  #   end
  module RSpec
    # Registers the around hook on an RSpec configuration.
    # @param config [RSpec::Core::Configuration]
    # @return [void]
    def self.install(config)
      config.around(:example) do |example|
        if example.metadata[:neverblock] == false
          example.run
        else
          timeout = example.metadata.fetch(:timeout) { Testing.default_timeout }
          Testing.run(timeout: timeout, label: example.full_description) { example.run }
        end
      end
    end
  end
end

RSpec.configure { |config| NeverBlock::RSpec.install(config) }
