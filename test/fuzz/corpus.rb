# frozen_string_literal: true

require_relative "../neverblock/server/fuzz_cases"

module NeverBlockFuzz
  # The inputs the fuzzer starts from, and its dictionary.
  #
  # Seeds: every string literal of the server tests that looks like HTTP
  # (holds a CRLF or "HTTP/1"): the valid, refused and ambiguous requests of
  # framing_test.rb, head_parser_test.rb and the others, as Ruby's compiler
  # reads them (escapes decoded; an interpolated literal gives its parts), so
  # a case added there is fuzzed from then on without listing it here. Then
  # cases of the server fuzz test's generator (FuzzCases: valid pipelines,
  # lying chunked bodies, oversized requests, its own mutations), made from
  # the run's seed.
  #
  # Dictionary: the short literals of those files (header names, chunk
  # extensions, bare CRs, ...) and the names and values below.
  module Corpus
    TEST_FILES = File.expand_path("../neverblock/server/*_test.rb", __dir__)

    TOKENS = ["GET ", "POST ", "HEAD ", "PUT ", "OPTIONS ", "CONNECT ", "PRI ", " HTTP/1.1\r\n", " HTTP/1.0\r\n",
              "Host: x\r\n", "Host: [::1]:80\r\n", "Host: a:\r\n", "Content-Length: ", "Content-Length: 0\r\n",
              "Transfer-Encoding: chunked\r\n", "Transfer-Encoding: gzip, chunked\r\n", "Connection: keep-alive\r\n",
              "Connection: close\r\n", "Connection: Upgrade\r\nUpgrade: websocket\r\n", "Expect: 100-continue\r\n",
              "Cookie: a=1\r\n", "X_A: 1\r\n", "\r\n\r\n", "0\r\n\r\n", "0\r\nX-T: t\r\n\r\n", "5;a=\"b\"\r\nhello\r\n",
              "\r\n 5", "\r\n\tfolded", ":", ";", "?", "#", "%00", "/", "*", "\t", " ", "\0", "\r", "\n", "\xFF",
              "\xC3\xA9"].map(&:b).freeze

    module_function

    # @param random [Random] makes the generator's cases.
    # @param generated [Integer] how many of those.
    # @return [Array<Array<String>>] seeds and tokens, binary and frozen.
    def load(random, generated: 400)
      literals = Dir[TEST_FILES].sort.flat_map { |path| literals(path) }.uniq
      seeds = literals.select { |text| text.include?("\r\n") || text.include?("HTTP/1") }
      seeds += generated(random, generated)
      tokens = TOKENS + literals.select { |text| text.bytesize.between?(1, 40) }
      [seeds.map { |text| text.b.freeze }.uniq, tokens.map { |text| text.b.freeze }.uniq]
    end

    # The String literals of a Ruby file, compiled but not run.
    def literals(path)
      strings = []
      collect(RubyVM::InstructionSequence.compile_file(path).to_a, strings)
      strings
    end

    # An iseq's array (see RubyVM::InstructionSequence#to_a) begins with its
    # name, path and labels: only its catch table and instructions are walked.
    def collect(node, strings)
      case node
      when Array
        node = node[12..] if node.first == "YARVInstructionSequence/SimpleDataFormat"
        node.each { |child| collect(child, strings) }
      when Hash then node.each_value { |child| collect(child, strings) }
      when String then strings << node
      end
    end

    # Cases of FuzzCases (test/neverblock/server/fuzz_cases.rb): half of
    # them valid pipelines, which mutate into near misses of a valid request.
    def generated(random, count)
      generator = Object.new.extend(FuzzCases)
      Array.new(count) { |i| i.even? ? generator.valid_pipeline(random).first : generator.fuzz_case(random).first }
    end
  end
end
