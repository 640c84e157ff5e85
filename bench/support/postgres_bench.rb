# frozen_string_literal: true

require_relative "isolated"
require_relative "peers"
require_relative "postgres_server"

module NeverBlockBench
  # What the PostgreSQL benchmarks (bench/db.rb, bench/activerecord.rb) do
  # before measuring. Included in a benchmark class that has @options
  # (with :selector) and a `header` method; sets @selector and @probe.
  module PostgresBench
    private

    # Checks the server, sets the io-event selector, probes what NeverBlock
    # uses and prints the header.
    #
    # @return [Boolean] false, after a warning, when nothing can be measured
    def ready_to_measure?
      if (problem = PostgresServer.problem)
        warn problem
        return false
      end
      @selector = Peers.use_selector(@options[:selector])
      @probe = Peers.probe
      puts header
      if @probe.is_a?(Isolated::Failure) || @probe.neverblock_selector != @selector
        warn "NeverBlock does not run on the #{@selector} selector (see above); not measuring"
        return false
      end
      true
    end

    def versions_text
      return "neverblock (version unknown, the probe failed)" if @probe.is_a?(Isolated::Failure)

      "neverblock #{@probe.neverblock}, io-event #{@probe.io_event}"
    end
  end
end
