# frozen_string_literal: true

require "io/event"

module NeverBlock
  # Picks the io-event selector class: EPoll by default; io_uring or select(2)
  # when asked for with `NEVERBLOCK_SELECTOR=uring|epoll|select` (or the
  # `selector:` option).
  module Selector
    NAMES = { "epoll" => :EPoll, "uring" => :URing, "select" => :Select, "kqueue" => :KQueue }.freeze

    # @param name [String, Symbol, nil] nil reads `ENV["NEVERBLOCK_SELECTOR"]`.
    # @return [Class] an IO::Event::Selector class.
    # @raise [ArgumentError] for a name NeverBlock does not know.
    def self.resolve(name = nil)
      name = (name || ENV.fetch("NEVERBLOCK_SELECTOR", "")).to_s.strip.downcase
      return default if name.empty?

      constant = NAMES.fetch(name) do
        raise ArgumentError, "unknown selector #{name.inspect} (NEVERBLOCK_SELECTOR); use one of: #{NAMES.keys.join(', ')}"
      end
      return IO::Event::Selector.const_get(constant) if IO::Event::Selector.const_defined?(constant)

      fallback = default
      NeverBlock.logger.warn("NeverBlock") do
        "selector #{name} is not available in this build of io-event; using #{fallback.name}"
      end
      fallback
    end

    # @return [Class] EPoll where it exists (Linux), else KQueue, else Select.
    def self.default
      %i[EPoll KQueue].each do |constant|
        return IO::Event::Selector.const_get(constant) if IO::Event::Selector.const_defined?(constant)
      end
      IO::Event::Selector::Select
    end
  end
end
