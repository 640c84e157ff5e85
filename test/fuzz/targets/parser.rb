# frozen_string_literal: true

require "neverblock/server"

module NeverBlockFuzz
  module Targets
    # NeverBlock::Server::Parser#<<: the whole path from a connection's reads
    # to requests, C and Ruby (http_head.c, llhttp, the Parser's own framing,
    # ChunkedBody). Each case feeds a mutated input in random reads (one,
    # a few, or a byte at a time), as bounded strings (BoundedString), to
    # two Parsers with the same random limits, one with the C head parser
    # and one without.
    #
    # Oracles, beside the sanitizers: #<< raises nothing but HTTPError, with
    # a status the server answers (400, 413, 414, 431, 501, 505, or nil after an
    # upgrade); no complete request has a body over max_body; and both
    # Parsers read the same requests, envs, bodies and refusal (what
    # head_parser_test.rb checks on the fuzz generator's cases, here on
    # mutated ones and tiny limits).
    class Parser < Target
      Parser = NeverBlock::Server::Parser
      Limits = NeverBlock::Server::Limits
      HTTPError = NeverBlock::Server::HTTPError

      STATUSES = [nil, 400, 413, 414, 431, 501, 505].freeze
      # Per limit: tiny values, the fuzz test's, the defaults.
      SIZES = { max_request_target: [1, 2, 3, 8, 64, 2048, 8192], max_header_bytes: [1, 8, 16, 64, 300, 8192, 65_536],
                max_headers: [1, 2, 3, 5, 40, 100], max_body: [1, 2, 5, 16, 300, 65_536, 10 * 1024 * 1024] }.freeze


      # One case.
      # @param random [Random]
      # @param recorder [Recorder] told the input before anything runs.
      def call(random, recorder)
        data = @mutator.input(random)
        limits = SIZES.transform_values { |sizes| random.rand(3).zero? ? sizes[random.rand(sizes.size)] : sizes[-2] }
        # Bodies stay in memory (compared as Strings), but for one case in
        # 50, whose bodies over a few bytes go to a Tempfile.
        limits[:max_body_in_memory] = random.rand(50).zero? ? random.rand(1..64) : 16 * 1024 * 1024
        cuts = cuts(data.bytesize, random)
        recorder.record(data, limits: limits, cuts: cuts)

        limits = Limits.build(limits)
        pieces = [0, *cuts, data.bytesize].each_cons(2).map { |from, to| BoundedString.new(data.byteslice(from, to - from)) }
        with_c = outcome(limits, pieces, true)
        without = outcome(limits, pieces, false)
        @counts[with_c[1] ? :"refused #{with_c[1].first.inspect}" : :read] += 1
        @counts[:requests] += with_c[0].size
        return if with_c == without

        raise Failure, "the Parser with the C head parser reads otherwise than without it:\n" \
                       "  with:    #{with_c.inspect[0, 1500]}\n  without: #{without.inspect[0, 1500]}"
      end

      # Parses the inputs whole, one Parser each (the leak check: see Worker).
      def repeat(inputs, times)
        limits = Limits.build({})
        times.times do |i|
          parser = Parser.new(limits, SERVER_ENV, "localhost", "8080")
          begin
            parser << inputs[i % inputs.size]
          rescue HTTPError
            nil
          end
          parser.requests.each(&:close)
        end
      end

      private

      # Where the input is split into reads: nowhere, at a few random
      # places, or (short inputs, now and then) after every byte.
      def cuts(size, random)
        return (1...size).to_a if size < 300 && random.rand(10).zero?

        Array.new(random.rand(0..4)) { random.rand(size + 1) }.sort.uniq
      end

      # What a Parser makes of the reads: [requests, refusal, in_message?, in_body?].
      def outcome(limits, pieces, head_parser)
        parser = Parser.new(limits, SERVER_ENV, "localhost", "8080", head_parser)
        refusal = nil
        pieces.each do |piece, _block|
          parser << piece
        rescue HTTPError => e
          raise Failure, "refused with status #{e.status.inspect}: #{e.message}" unless STATUSES.include?(e.status)

          refusal = [e.status, e.message]
          break
        end
        requests = parser.requests.map { |request| described(request, limits) }
        [requests, refusal, parser.in_message?, parser.in_body?]
      ensure
        parser&.requests&.each(&:close)
      end

      def described(request, limits)
        if request.complete && request.body_bytes > limits.max_body
          raise Failure, "a request with a #{request.body_bytes}-byte body, over max_body (#{limits.max_body})"
        end

        # Keys and values with their encodings and frozenness, as head_parser_test.rb compares them.
        env = request.env.map { |key, value| [key, value, value.is_a?(String) && [value.encoding, value.frozen?]] }
        body = request.spooled? ? :spooled : request.body
        [env.sort_by(&:first), body, request.body_bytes, request.complete, request.keep_alive,
         request.expects_continue, request.head, request.http10]
      end
    end
  end
end
