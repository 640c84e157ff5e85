# frozen_string_literal: true

module NeverBlockFuzz
  # Keeps the case being run where the supervisor can read it after the
  # worker dies: a sanitizer report ends the process at once, with no Ruby
  # code run after it, so the input must be out of the process before the
  # call that may crash. A file mapped into memory (IO::Buffer.map, shared)
  # costs a memory copy per case, no system call.
  #
  # Layout: the case number (u64), the record's length (u64), then the
  # record: Marshal of [input bytes, parameters].
  class Recorder
    SIZE = 1 << 20 # bytes: Mutator::MAX_SIZE and the parameters fit

    # @param path [String] the file (made or overwritten, SIZE bytes).
    def initialize(path)
      Warning[:experimental] = false # IO::Buffer is experimental in Ruby 3.1
      @file = File.open(path, File::RDWR | File::CREAT | File::TRUNC, 0o600)
      @file.truncate(SIZE)
      @buffer = IO::Buffer.map(@file, SIZE, 0)
    end

    # Starts case `number` (its record empty until #record).
    def start(number)
      @buffer.set_value(:u64, 0, number)
      @buffer.set_value(:u64, 8, 0)
    end

    # @param data [String] the case's input.
    # @param parameters [Hash] what else the case is made of (limits, offsets...).
    def record(data, **parameters)
      bytes = Marshal.dump([data, parameters])
      bytes = Marshal.dump([data.byteslice(0, SIZE / 2), parameters.merge(truncated: true)]) if bytes.bytesize > SIZE - 16
      @buffer.set_string(bytes, 16)
      @buffer.set_value(:u64, 8, bytes.bytesize)
    end

    # @param path [String] a file a worker recorded into.
    # @return [Array(Integer, String, Hash)] the case number, its input and
    #   parameters (nil and {} when it had recorded none).
    def self.read(path)
      bytes = File.binread(path)
      number, length = bytes.unpack("Q<Q<")
      return [number, nil, {}] if length.nil? || length.zero?

      data, parameters = Marshal.load(bytes.byteslice(16, length)) # rubocop:disable Security/MarshalLoad -- our own file
      [number, data, parameters]
    end
  end
end
