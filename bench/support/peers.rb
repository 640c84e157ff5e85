# frozen_string_literal: true

require_relative "isolated"

module NeverBlockBench
  # The event-loop libraries a benchmark compares (NeverBlock and Async, both
  # on io-event), and the io-event selector they share.
  #
  # io-event picks its best selector by default (URing where it was built
  # against liburing), and Async takes that default; NeverBlock defaults to
  # EPoll. A comparison is only fair on the same selector, so {.use_selector}
  # sets both libraries' variables before any cell is forked:
  # NEVERBLOCK_SELECTOR for NeverBlock, IO_EVENT_SELECTOR for Async.
  # {.probe} then checks, in a child, what each one really uses.
  module Peers
    # --selector value => IO::Event::Selector constant.
    SELECTORS = { "epoll" => "EPoll", "uring" => "URing", "select" => "Select" }.freeze
    DEFAULT_SELECTOR = "epoll"

    # What a child process found: versions loaded and selector classes used.
    # Fields are nil for a library that is not installed; an error string
    # replaces a selector that could not be determined.
    Probe = Struct.new(:neverblock, :async, :io_event, :neverblock_selector, :async_selector,
                       keyword_init: true)

    module_function

    # @param name [String] "epoll", "uring" or "select"
    # @return [String] the IO::Event::Selector constant name, e.g. "EPoll"
    # @raise [ArgumentError] for an unknown name
    def use_selector(name)
      key = name.to_s.strip.downcase
      constant = SELECTORS.fetch(key) do
        raise ArgumentError, "unknown selector #{name.inspect}; use one of: #{SELECTORS.keys.join(', ')}"
      end
      ENV["NEVERBLOCK_SELECTOR"] = key
      ENV["IO_EVENT_SELECTOR"] = constant
      constant
    end

    # Loads NeverBlock and (if installed) Async in a forked child, starts one
    # event loop of each and reports the versions loaded and the selector
    # each loop uses.
    #
    # @return [Probe, Isolated::Failure]
    def probe
      Isolated.run(timeout: 60) do
        require "neverblock"
        require "io/event"
        probe = Probe.new(neverblock: NeverBlock::VERSION, io_event: IO::Event::VERSION)
        probe.neverblock_selector = NeverBlock.run { short_name(Fiber.scheduler.selector_class) }
        begin
          require "async"
        rescue LoadError
          next probe
        end
        probe.async = Async::VERSION
        probe.async_selector = Async { short_name(async_selector_class) }.wait
        probe
      end
    end

    # The selector of the running Async reactor. Async has no public reader
    # for it; @selector has held it since async 2.0. If that changes, this
    # says so instead of guessing.
    def async_selector_class
      selector = Fiber.scheduler.instance_variable_get(:@selector)
      selector ? selector.class : "unknown (async keeps no @selector)"
    end

    def short_name(klass)
      klass.is_a?(Module) ? klass.name.split("::").last : klass.to_s
    end

    # @param probe [Probe, Isolated::Failure]
    # @return [String] e.g. "neverblock 0.1.0, async 2.23.1, io-event 1.11.2"
    def versions_text(probe)
      return "versions unknown (probe failed: #{probe})" if probe.is_a?(Isolated::Failure)

      ["neverblock #{probe.neverblock}", ("async #{probe.async}" if probe.async), "io-event #{probe.io_event}"]
        .compact.join(", ")
    end

    # @param probe [Probe, Isolated::Failure]
    # @param wanted [String] the constant {.use_selector} returned
    # @return [String] e.g. "io-event selector: EPoll for both NeverBlock and
    #   async (IO_EVENT_SELECTOR=EPoll, NEVERBLOCK_SELECTOR=epoll)"
    def selector_text(probe, wanted)
      variables = "IO_EVENT_SELECTOR=#{ENV.fetch('IO_EVENT_SELECTOR', nil)}, " \
                  "NEVERBLOCK_SELECTOR=#{ENV.fetch('NEVERBLOCK_SELECTOR', nil)}"
      if probe.is_a?(Isolated::Failure)
        return "io-event selector: #{wanted} asked for (#{variables}); not checked, the probe failed"
      end

      used = { "NeverBlock" => probe.neverblock_selector }
      used["async"] = probe.async_selector if probe.async
      if used.values.all?(wanted)
        "io-event selector: #{wanted} for #{used.size == 1 ? 'NeverBlock' : 'both NeverBlock and async'} (#{variables})"
      else
        "io-event selector: MISMATCH, #{used.map { |lib, name| "#{lib} #{name}" }.join(', ')}; " \
          "#{wanted} was asked for (#{variables})"
      end
    end

    # @param probe [Probe, Isolated::Failure]
    # @param wanted [String]
    # @return [Boolean] whether every loaded library uses the wanted selector
    def selector_matches?(probe, wanted)
      return false if probe.is_a?(Isolated::Failure)

      [probe.neverblock_selector, (probe.async_selector if probe.async)].compact.all?(wanted)
    end
  end
end
