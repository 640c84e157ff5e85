# frozen_string_literal: true

module NeverBlockFuzz
  # Turns seed inputs into new ones, AFL's "havoc" way: a few random edits
  # stacked on one seed (bit flips, bytes inserted, deleted or duplicated,
  # splices with another seed, dictionary tokens, long runs), plus the edits
  # that matter to HTTP framing: numbers (Content-Length, chunk sizes)
  # replaced by boundary values, and letters' case flipped (header names,
  # hex digits). Everything comes from the Random it is given, so a case is
  # reproduced from its seed alone.
  class Mutator
    # Numbers around the limits the parsers check: zero, signs, 2^31, 2^63
    # and 2^64 (overflow), 18 and 19 digits (the C parser's longest
    # Content-Length is 18), hex that overflows 64 bits, leading zeros.
    NUMBERS = ["0", "00", "-0", "-1", "+1", "1", "5", "9", "10", "65535", "65536", "65537", "2147483647",
               "2147483648", "4294967295", "4294967296", "9223372036854775807", "9223372036854775808",
               "18446744073709551615", "18446744073709551616", "999999999999999999", "1000000000000000000",
               "ffffffff", "FFFFFFFFFFFFFFFF", "10000000000000000", "7fffffffffffffff", "0x10", "1e3", "1_0",
               "0000000000000000000005", "１"].map(&:b).freeze

    # Bytes parsers treat specially.
    BYTES = [0, 9, 10, 11, 12, 13, 32, 34, 35, 37, 44, 47, 58, 59, 61, 63, 92, 127, 128, 192, 255].freeze

    # Maximum size of an input after mutation (bytes).
    MAX_SIZE = 200_000

    # @param seeds [Array<String>] binary inputs to start from (not empty).
    # @param tokens [Array<String>] dictionary: short strings to insert.
    def initialize(seeds, tokens)
      @seeds = seeds
      @tokens = tokens
    end

    # @return [String] a seed picked at random.
    def seed(random)
      @seeds[random.rand(@seeds.size)]
    end

    # @param random [Random]
    # @return [String] a new binary input: a seed with up to 8 edits, mostly
    #   one or two (so that many still parse, and the edit is where they
    #   stop), none in one case of 8 (the seeds themselves run too).
    def input(random)
      data = seed(random).b
      edits = [0, 1, 1, 1, 2, 3, 4, 8][random.rand(8)]
      edits.times { data = edit(data, random) }
      data.bytesize > MAX_SIZE ? data.byteslice(0, MAX_SIZE) : data
    end

    private

    def edit(data, random)
      size = data.bytesize
      at = random.rand(size + 1)
      case random.rand(14)
      when 0 # flip a bit
        data.setbyte(at, data.getbyte(at) ^ (1 << random.rand(8))) if at < size
      when 1 # set a byte to one parsers care about
        data.setbyte(at, BYTES[random.rand(BYTES.size)]) if at < size
      when 2 then data.insert(at, random.bytes(random.rand(1..8)))
      when 3 then data = delete(data, at, random.rand(1..[size - at, 1].max))
      when 4 then data.insert(at, data.byteslice(at, random.rand(1..64)) || "") # duplicate a range
      when 5 then data.insert(at, @tokens[random.rand(@tokens.size)])
      when 6 then data = splice(data, at, random)
      when 7 then data = number(data, random)
      when 8 then data.insert(at, (BYTES[random.rand(BYTES.size)].chr * long_run(random)).b)
      when 9 then data = data.byteslice(0, at) # truncate
      when 10 then flip_case(data, at)
      when 11 then data.insert(at, "\r\n")
      when 12 # move a range elsewhere: reorders lines and headers
        moved = data.byteslice(at, random.rand(1..64)) || ""
        data = delete(data, at, moved.bytesize)
        data.insert(random.rand(data.bytesize + 1), moved)
      else data.insert(at, NUMBERS[random.rand(NUMBERS.size)])
      end
      data
    end

    def delete(data, at, length)
      (data.byteslice(0, at) || "") + (data.byteslice(at + length, data.bytesize) || "")
    end

    # The head of `data` up to `at`, then the tail of another seed from a
    # random point: a request's head with another's body, two pipelines.
    def splice(data, at, random)
      other = seed(random)
      from = random.rand(other.bytesize + 1)
      (data.byteslice(0, at) || "") + other.byteslice(from, other.bytesize - from)
    end

    # Replaces a run of digits (or hex digits after a line start) with a
    # boundary number.
    def number(data, random)
      runs = []
      data.scan(/[0-9A-Fa-f]+/n) { runs << Regexp.last_match.offset(0) }
      return data if runs.empty?

      from, to = runs[random.rand(runs.size)]
      (data.byteslice(0, from) || "") + NUMBERS[random.rand(NUMBERS.size)] + data.byteslice(to, data.bytesize)
    end

    # Mostly short; sometimes past the usual limits (8 KiB, 64 KiB).
    def long_run(random)
      case random.rand(8)
      when 0 then random.rand(8_000..70_000)
      when 1, 2 then random.rand(200..5_000)
      else random.rand(1..64)
      end
    end

    def flip_case(data, at)
      ([at, data.bytesize].min...[at + 16, data.bytesize].min).each do |i|
        byte = data.getbyte(i)
        data.setbyte(i, byte ^ 0x20) if byte.between?(65, 90) || byte.between?(97, 122)
      end
    end
  end
end
