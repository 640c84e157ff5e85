# frozen_string_literal: true

require "neverblock/http_head"

module NeverBlockFuzz
  module Targets
    # NeverBlock::HTTPHead#parse (ext/neverblock/http_head), the C that reads
    # a connection's bytes first. Each case parses a mutated input with
    # random limits (tiny ones included: 0, 1, a few bytes, negative) at many
    # offsets: 0, the end and the bytes before it, random ones, and each
    # message boundary the parser itself reports (head_end plus
    # content_length, as the Parser walks a pipeline).
    #
    # Every parse reads a bounded string (BoundedString): under ASan a read
    # one byte past the data is reported. Oracles, beside the sanitizers:
    # - contract: an env only for a complete head ending at the first CRLF
    #   CRLF after the offset, within every limit, with the documented keys
    #   and no CR, LF or NUL in a value; nil or a Ruby exception
    #   (ArgumentError, TypeError, RangeError: misuse) otherwise;
    # - the cached Host: a head that parsed earlier requests (and kept their
    #   Host) gives the env that a new one gives;
    # - GC: now and then a parse runs under GC.stress, or after GC.compact,
    #   so that an object the extension holds without marking it is freed
    #   or moved under it.
    class HTTPHead < Target
      # Limits to pick from: the Parser's defaults and the fuzz test's, and
      # values no Limits would allow, which the C must still survive.
      LIMITS = [-1, 0, 1, 2, 3, 4, 5, 8, 16, 40, 100, 2048, 8192, 65_536, 10 * 1024 * 1024, (1 << 62)].freeze
      # max_target, max_header_bytes, max_headers, max_body of the server fuzz test.
      PERMISSIVE = [2048, 8192, 40, 65_536].freeze
      METHODS = %w[GET HEAD POST PUT DELETE OPTIONS PATCH].freeze
      BASE_ENVS = [{}, SERVER_ENV].freeze

      # One case.
      # @param random [Random]
      # @param recorder [Recorder] told the input before anything runs.
      def call(random, recorder)
        data = @mutator.input(random)
        # Each limit the fuzz test's (permissive) but one time in three, when
        # it is any of LIMITS: tiny limits decline nearly everything.
        limits = PERMISSIVE.map { |limit| random.rand(3).zero? ? LIMITS[random.rand(LIMITS.size)] : limit }
        base_env = BASE_ENVS[random.rand(BASE_ENVS.size)]
        offsets = offsets(data, random)
        gc = random.rand(400).zero? ? :stress : (random.rand(2000).zero? ? :compact : nil)
        recorder.record(data, limits: limits, base_env: base_env, offsets: offsets, gc: gc)

        bounded, _block = BoundedString.new(data)
        head = new_head(base_env, limits)
        GC.compact if gc == :compact
        offsets.each { |offset| walk(head, bounded, offset, base_env, limits, gc) }
        misuse(head, bounded, random) if random.rand(50).zero?
      end

      # Memory that parsing the same inputs over and over must not grow
      # (see Worker#leak_check): one HTTPHead per connection, as the server
      # makes them, parsing taken and declined heads.
      def repeat(inputs, times)
        head = nil
        times.times do |i|
          head = NeverBlock::HTTPHead.new(BASE_ENVS[1], "localhost", "8080", 2048, 8192, 40, 65_536) if (i % 8).zero?
          data = inputs[i % inputs.size]
          offset = 0
          while offset < data.bytesize && head.parse(data, offset)
            offset = head.head_end + head.content_length
          end
        end
      end

      private

      def offsets(data, random)
        size = data.bytesize
        picks = [0, size, *(1..4).map { |back| size - back }.select(&:positive?)]
        picks.concat(Array.new(random.rand(1..6)) { random.rand(size + 1) })
        picks.uniq
      end

      def new_head(base_env, limits)
        NeverBlock::HTTPHead.new(base_env, "localhost", "8080", *limits)
      end

      # Parses at `offset`, then on at each message boundary the parse
      # reports, like the Parser.
      def walk(head, data, offset, base_env, limits, gc)
        8.times do
          result = parse(head, data, offset, gc)
          @counts[result ? :taken : :declined] += 1
          return unless result

          check(*result, data, offset, limits)
          fresh = parse(new_head(base_env, limits), data, offset, nil)
          unless fresh == result
            raise Failure, "a new HTTPHead parses offset #{offset} otherwise than one that parsed earlier requests " \
                           "(its cached Host?): #{fresh.inspect[0, 300]} vs #{result.inspect[0, 300]}"
          end
          offset = result[1] + result[2]
          return if offset >= data.bytesize
        end
      end

      # @return [Array, nil] the env and what the readers say of it, or nil.
      def parse(head, data, offset, gc)
        GC.stress = true if gc == :stress
        env = head.parse(data, offset)
        env && [env, head.head_end, head.content_length, head.head?, head.http10?, head.keep_alive?]
      ensure
        GC.stress = false if gc == :stress
      end

      # The parse's contract (see the top of http_head.c).
      def check(env, head_end, length, head, http10, keep_alive, data, offset, limits)
        max_target, _max_header_bytes, max_headers, max_body = limits
        unless head_end > offset && head_end <= data.bytesize &&
               data.byteslice(offset, head_end - offset).index("\r\n\r\n") == head_end - offset - 4
          raise Failure, "head_end #{head_end}: not the first CRLF CRLF after offset #{offset} (#{data.bytesize} bytes)"
        end
        raise Failure, "content_length #{length} over max_body (#{max_body})" unless length.zero? || length.between?(0, max_body)

        method = env["REQUEST_METHOD"]
        raise Failure, "REQUEST_METHOD #{method.inspect}" unless METHODS.include?(method)
        raise Failure, "head? is #{head} for #{method}" unless head == (method == "HEAD")
        unless data.byteslice(offset, method.bytesize + 2) == "#{method} /"
          raise Failure, "REQUEST_METHOD #{method}: not what the data at offset #{offset} begins with"
        end
        protocol = http10 ? "HTTP/1.0" : "HTTP/1.1"
        raise Failure, "SERVER_PROTOCOL #{env['SERVER_PROTOCOL'].inspect}, http10? #{http10}" unless env["SERVER_PROTOCOL"] == protocol

        connection = env["HTTP_CONNECTION"]&.downcase
        unless keep_alive == (http10 ? connection == "keep-alive" : connection != "close")
          raise Failure, "keep_alive? #{keep_alive} for #{protocol} with Connection #{env['HTTP_CONNECTION'].inspect}"
        end

        path = env["PATH_INFO"]
        raise Failure, "PATH_INFO #{path.inspect}" unless path.is_a?(String) && path.start_with?("/")
        raise Failure, "PATH_INFO over max_target (#{max_target})" if path.bytesize > max_target

        headers = env.keys.count { |key| key.start_with?("HTTP_") || key == "CONTENT_TYPE" || key == "CONTENT_LENGTH" }
        raise Failure, "#{headers} headers, over max_headers (#{max_headers})" if headers > max_headers

        env.each do |key, value|
          raise Failure, "env key #{key.inspect} is not a frozen String" unless key.is_a?(String) && key.frozen?
          next unless value.is_a?(String)
          raise Failure, "env[#{key.inspect}] holds a CR, LF or NUL: #{value.inspect}" if value.match?(/[\r\n\0]/n)
        end
        @counts[:"#{method} #{protocol}"] += 1
      end

      # Calls the C outside its contract: it must return (1.5 is offset 1;
      # an HTTPHead never initialized declines everything) or raise
      # ArgumentError, TypeError or RangeError, never crash.
      def misuse(head, data, random)
        calls = [
          -> { head.parse(data, -1 - random.rand(4)) },
          -> { head.parse(data, data.bytesize + 1 + random.rand(4)) },
          -> { head.parse(data, 1 << 64) },
          -> { head.parse(data, 1.5) },
          -> { head.parse(nil, 0) },
          -> { head.parse(:symbol, 0) },
          -> { NeverBlock::HTTPHead.new({}, "h", "80", 1 << 64, 1, 1, 1) },
          -> { NeverBlock::HTTPHead.new([], "h", "80", 1, 1, 1, 1) },
          -> { NeverBlock::HTTPHead.new({}, nil, "80", 1, 1, 1, 1) },
          -> { NeverBlock::HTTPHead.allocate.parse(data, 0) },
          -> { head.dup.parse(data, 0) }
        ]
        call = calls[random.rand(calls.size)]
        Sanitizer.raising_through_c(&call)
        @counts[:misuse_returned] += 1
      rescue ArgumentError, TypeError, RangeError
        @counts[:misuse_raised] += 1
      end
    end
  end
end
