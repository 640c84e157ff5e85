# frozen_string_literal: true

require "neverblock/http_head"
require "neverblock/server"

module NeverBlockFuzz
  module Targets
    # NeverBlock::HTTPHead.response_headers (ext/neverblock/http_head/response_head.c)
    # beside the Ruby walk it stands in for (Response#add_headers). Each case
    # turns a mutated request head into a response's headers: its lines,
    # split at the first colon, are the names and values (CR, LF, NUL and
    # bytes that are not ASCII as the mutations leave them); now and then a
    # name becomes a framing one in a random case or a `rack.` one, values
    # are grouped into Arrays, and one is an object the Ruby walk calls its
    # own way (an Integer, a String subclass, a Symbol name).
    #
    # Oracles, beside the sanitizers: where the C writes, the Ruby walk
    # writes the same bytes and gives the same flags and content-length
    # value, without raising; where it declines, the head is as it was.
    class ResponseHead < Target
      FRAMING = %w[content-length transfer-encoding date connection].freeze
      HEAD = "HTTP/1.1 200 OK\r\n"

      # A String the Ruby walk reads through its own `to_s`.
      class LoudString < String
        def to_s = upcase
      end

      # @param mutator [Mutator] makes each case's input (request heads).
      def initialize(mutator)
        super
        @walker = NeverBlock::Server::Response.new(nil, 1)
      end

      # One case.
      # @param random [Random]
      # @param recorder [Recorder] told the input before anything runs.
      def call(random, recorder)
        data = @mutator.input(random)
        seed = random.rand(1 << 30)
        recorder.record(data, seed: seed)
        headers = headers_from(data, Random.new(seed))
        GC.compact if random.rand(2000).zero?
        compare(headers)
      end

      # The same work over and over, for the leak check.
      def repeat(inputs, times)
        times.times { |i| compare(headers_from(inputs[i % inputs.size], Random.new(i))) }
      end

      private

      def compare(headers)
        head = +HEAD
        out = [nil]
        flags = NeverBlock::HTTPHead.response_headers(head, headers, out)
        if flags.nil?
          @counts[:declined] += 1
          raise Failure, "declined #{headers.inspect[0, 500]} but changed the head to #{head.inspect[0, 500]}" unless head == HEAD

          return
        end

        @counts[:written] += 1
        ruby = +HEAD
        values = @walker.instance_variable_get(:@values)
        values[0] = nil
        ruby_flags = begin
          @walker.__send__(:add_headers, ruby, headers)
        rescue StandardError => e
          raise Failure, "C wrote #{headers.inspect[0, 500]}, the Ruby walk raised #{e.class}: #{e.message[0, 200]}"
        end
        unless ruby == head && ruby_flags == flags && (flags & 1).zero? == values[0].nil? && (values[0].nil? || values[0].equal?(out[0]))
          raise Failure, "#{headers.inspect[0, 500]}: C #{head.inspect[0, 500]} (#{flags}, #{out[0].inspect}), " \
                         "Ruby #{ruby.inspect[0, 500]} (#{ruby_flags}, #{values[0].inspect})"
        end
      end

      # The input's lines (after the first) as headers, some changed (see the class).
      def headers_from(data, random)
        headers = {}
        data.b.split("\r\n").drop(1).each do |line|
          name, value = line.split(":", 2)
          next if name.nil?

          name = name.force_encoding(random.rand(3).zero? ? Encoding::UTF_8 : Encoding::BINARY)
          value = (value || "").sub(/\A /, "")
          case random.rand(12)
          when 0 then name = FRAMING[random.rand(FRAMING.size)].chars.map { |c| random.rand(2).zero? ? c.upcase : c }.join
          when 1 then name = "rack.#{name}"
          when 2 then value = [value, value.reverse]
          when 3 then value = LoudString.new(value)
          when 4 then value = value.bytesize
          when 5 then name = name.b.to_sym
          end
          headers[name] = value
        end
        headers
      end
    end
  end
end
