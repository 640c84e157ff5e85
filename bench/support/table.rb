# frozen_string_literal: true

module NeverBlockBench
  # A plain-text table with aligned columns, for benchmark output.
  #
  #   table = Table.new(["client", "0 ms"], align: %i[left right])
  #   table << ["blocking", "2400"]
  #   puts table
  class Table
    # @param headers [Array<String>]
    # @param align [Array<Symbol>] :left or :right per column; the first column
    #   defaults to :left and the rest to :right
    def initialize(headers, align: nil)
      @headers = headers.map(&:to_s)
      @align = align || [:left] + [:right] * (headers.size - 1)
      @rows = []
    end

    # @param row [Array<#to_s>] one cell per column; nil prints as empty
    # @return [self]
    def <<(row)
      @rows << row.map(&:to_s)
      self
    end

    # @return [String] header, rule and rows, each line ending in a newline
    def to_s
      widths = @headers.each_index.map { |i| ([@headers] + @rows).map { |row| row[i].to_s.size }.max }
      lines = [line(@headers, widths), widths.map { |width| "-" * width }.join("  ")]
      lines.concat(@rows.map { |row| line(row, widths) })
      lines.map { |text| "#{text.rstrip}\n" }.join
    end

    private

    def line(cells, widths)
      cells.each_with_index.map do |cell, i|
        @align[i] == :right ? cell.to_s.rjust(widths[i]) : cell.to_s.ljust(widths[i])
      end.join("  ")
    end
  end
end
