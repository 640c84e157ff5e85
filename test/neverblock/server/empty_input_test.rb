# frozen_string_literal: true

require_relative "server_helper"

# The shared rack.input of requests without a body reads like an empty
# binary StringIO, and nothing a reader does to it changes what the next
# reader sees.
class ServerEmptyInputTest < PlainTest
  INPUT = NeverBlock::Server::EmptyInput::INSTANCE

  def empty_stringio
    StringIO.new(String.new(encoding: Encoding::BINARY))
  end

  def test_reads_like_an_empty_stringio
    [[], [nil], [0], [1], [16_384]].each do |args|
      assert_equal empty_stringio.read(*args).inspect, INPUT.read(*args).inspect, "read(#{args.join(', ')})"
    end
    assert_nil INPUT.gets
    assert_equal [], INPUT.each.to_a
  end

  def test_read_into_a_buffer_empties_the_buffer
    [nil, 0, 5].each do |length|
      buffer = +"left over"
      result = INPUT.read(length, buffer)
      assert_equal "", buffer
      assert(length&.positive? ? result.nil? : result.equal?(buffer), "read(#{length.inspect}, buffer)")
    end
  end

  def test_a_negative_length_is_refused_as_by_io
    assert_raises(ArgumentError) { INPUT.read(-1) }
  end

  def test_close_leaves_it_readable_for_the_next_request
    INPUT.close
    assert_equal "", INPUT.read
    assert_equal Encoding::BINARY, INPUT.read.encoding
  end
end
