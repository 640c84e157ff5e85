# frozen_string_literal: true

module NeverBlockBench
  # Repeated measurements of one cell (seconds, or any number), summarised
  # the way a noisy machine calls for: the median as the result, the range
  # beside it so a reader sees how far the runs spread.
  #
  #   samples = Samples.new([0.45, 1.3, 0.62])
  #   samples.median  # => 0.62
  #   samples.to_s    # => "0.45 0.62 1.30"
  class Samples
    # @return [Array<Float>] the values, in the order measured
    attr_reader :values

    # @param values [Array<Numeric>]
    def initialize(values)
      @values = values.map(&:to_f)
    end

    # @return [Float, nil] the middle value (mean of the two middle ones for
    #   an even count); nil when there are none
    def median
      return nil if @values.empty?

      sorted = @values.sort
      middle = sorted.size / 2
      sorted.size.odd? ? sorted[middle] : (sorted[middle - 1] + sorted[middle]) / 2.0
    end

    # @return [Float, nil]
    def min
      @values.min
    end

    # @return [Float, nil]
    def max
      @values.max
    end

    def empty?
      @values.empty?
    end

    # @param digits [Integer] decimals per value
    # @return [String] every value, sorted, e.g. "0.45 0.62 1.30"
    def to_s(digits: 2)
      @values.sort.map { |value| format("%.#{digits}f", value) }.join(" ")
    end
  end
end
