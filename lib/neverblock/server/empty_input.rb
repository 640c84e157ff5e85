# frozen_string_literal: true

module NeverBlock
  class Server
    # `rack.input` of every request without a body: one shared object that
    # reads as an empty binary stream, so a GET allocates no StringIO.
    #
    # It holds no state (no position, no buffer), so requests cannot see
    # each other through it; {#close} does nothing, as closing a stream
    # that is always at its end changes nothing a reader could observe.
    # Answers the Rack 3 input contract (`gets`, `read`, `each`, `close`)
    # and what apps still call on a StringIO (`rewind`, `eof?`, `size`).
    class EmptyInput
      # @return [nil] always at the end.
      def gets
        nil
      end

      # IO#read's contract on an empty stream: `read` and `read(0)` give ""
      # (the buffer, emptied, when given), `read(n)` for n > 0 gives nil.
      # @param length [Integer, nil]
      # @param buffer [String, nil] emptied, and returned instead of a new String
      # @return [String, nil]
      # @raise [ArgumentError] for a negative length.
      def read(length = nil, buffer = nil)
        raise ArgumentError, "negative length #{length} given" if length&.negative?

        buffer&.clear
        return nil if length&.positive?

        buffer || String.new(encoding: Encoding::BINARY)
      end

      # Yields nothing.
      # @return [self, Enumerator] an (empty) Enumerator without a block
      def each
        return enum_for(:each) unless block_given?

        self
      end

      # @return [0]
      def rewind
        0
      end

      # @return [true]
      def eof?
        true
      end

      # @return [0] bytes in the stream.
      def size
        0
      end

      # Does nothing: the object is shared, and an empty stream stays empty.
      # @return [nil]
      def close
        nil
      end

      # @return [Encoding] ASCII-8BIT, as Rack::Lint checks of an input.
      def external_encoding
        Encoding::BINARY
      end

      # @return [true]
      def binmode?
        true
      end

      # The one instance every bodiless request shares.
      INSTANCE = new.freeze
    end
  end
end
