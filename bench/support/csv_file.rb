# frozen_string_literal: true

module NeverBlockBench
  # Writes a small CSV file (RFC 4180 quoting), without the csv gem, which
  # is not a default gem on every Ruby the benchmarks run on.
  module CsvFile
    module_function

    # @param path [String]
    # @param headers [Array<String>]
    # @param rows [Array<Array>] nil cells are written empty
    # @return [String] path
    def write(path, headers, rows)
      File.write(path, ([headers] + rows).map { |row| row.map { |cell| cell(cell) }.join(",") }.join("\n") + "\n")
      path
    end

    def cell(value)
      text = value.to_s
      text.match?(/[",\n]/) ? "\"#{text.gsub('"', '""')}\"" : text
    end
  end
end
