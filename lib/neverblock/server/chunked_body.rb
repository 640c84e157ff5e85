# frozen_string_literal: true

module NeverBlock
  class Server
    # Reads a `Transfer-Encoding: chunked` request body (RFC 9112 7.1) as it
    # arrives, over as many reads as it spans, and refuses any framing a
    # front proxy could read another way. The {Parser} gives it the bytes
    # after the head; llhttp never sees a body. llhttp 8.1 (the llhttp gem)
    # skips the two bytes after chunk data without checking them, so
    # `5\r\nhelloXX0\r\n\r\n` was a complete body to it ("XX" dropped) while
    # a proxy that checks them reads on: the bytes after such a body could be
    # served as a request the proxy never sent.
    #
    # Refused with 400: a chunk size that is not 1-16 hex digits, chunk data
    # not followed by CRLF, a bare CR or LF (lines end in CRLF), an extension
    # that is not `;name` or `;name=value` (a token or quoted string, with
    # optional blanks around `;` and `=`), a size line over {LINE_MAX}, a
    # trailer line that is not `name: value`. 413 when the chunk sizes add up
    # to more than `max_body`; 431 when trailers exceed `max_header_bytes`
    # or `max_headers`. Trailers are checked and dropped, as before. 400 too
    # when the framing outgrows the data it frames: each chunk may bring 16
    # bytes of size line, extensions and CRLFs, plus twice its size, and a
    # body that runs more than {EXCESS_MAX} bytes over that allowance is
    # refused (a chunk's unused allowance pays off earlier excess, but is
    # not banked; long extensions on tiny chunks cost a regex match per line
    # and carry nothing).
    #
    # Its cost is per read, not per chunk, where it can be: a plain size
    # line (hex digits and CRLF, all in the read) is read byte by byte
    # without allocating, and the data of chunks under {SMALL} bytes is
    # gathered and yielded once per read. A one-byte chunk costs about
    # 0.2 µs of CPU (Ruby 3.4 + YJIT), not a method call and a handful of
    # Strings.
    class ChunkedBody
      # Longest chunk-size line (size and extensions, CRLF excluded).
      LINE_MAX = 4096
      # Framing bytes beyond each chunk's allowance (16 + twice its size)
      # that a body may run up.
      EXCESS_MAX = 16 * 1024
      # Chunks with less data than this are gathered into one String per
      # read; larger ones are yielded as they are.
      SMALL = 4096
      # A hex digit's value by byte; nil for other bytes.
      HEX = Array.new(256) { |byte| [byte].pack("C").then { |char| char.match?(/\A\h\z/) ? char.to_i(16) : nil } }.freeze

      # RFC 9110 tchar.
      TCHAR = "!#$%&'*+\\-.^_`|~0-9A-Za-z"
      # A chunk extension list after the size (RFC 9112 7.1.1, with BWS).
      EXTENSIONS = /\A(?:[ \t]*;[ \t]*[#{TCHAR}]+(?:[ \t]*=[ \t]*(?:[#{TCHAR}]+|"(?:[\t \x21\x23-\x5B\x5D-\x7E\x80-\xFF]|\\[\t \x21-\x7E\x80-\xFF])*"))?)*\z/n
      # Bytes a field value may not hold (CTLs but HTAB, and DEL).
      VALUE_CTL = "\x00-\x08\x0A-\x1F\x7F"
      CR = 13
      LF = 10
      private_constant :TCHAR, :EXTENSIONS, :VALUE_CTL, :CR, :LF, :HEX

      # @param limits [Limits] max_body, max_header_bytes, max_headers.
      def initialize(limits)
        @limits = limits
        @state = :size # :size, :data, :data_cr, :data_lf, :trailer, :done
        @line = nil    # a line begun in an earlier read
        @left = 0      # bytes of the current chunk's data still to come
        @total = 0     # the chunk sizes so far
        @trailer_bytes = 0
        @trailers = 0
        @excess = 0    # framing bytes over the chunks' allowance so far
      end

      # @return [Boolean] true once the last chunk and the trailers ended.
      def finished?
        @state == :done
      end

      # Takes what `data` holds of the body from `offset` on, yielding each
      # stretch of chunk data as it goes.
      # @param data [String] binary.
      # @param offset [Integer]
      # @yieldparam bytes [String] chunk data.
      # @return [Integer] the offset after what it took: where the next
      #   message starts once {#finished?}, else `data.bytesize`.
      # @raise [HTTPError] 400, 413 or 431 (see the class comment).
      def take(data, offset)
        size = data.bytesize
        gathered = nil # small chunks' data, yielded once at the end
        while offset < size
          case @state
          when :data
            count = @left < size - offset ? @left : size - offset
            if count < SMALL
              (gathered ||= String.new(encoding: Encoding::BINARY)) << data.byteslice(offset, count)
            else
              if gathered
                yield gathered
                gathered = nil
              end
              yield data.byteslice(offset, count)
            end
            offset += count
            @state = :data_cr if (@left -= count).zero?
          when :data_cr
            if data.getbyte(offset + 1) == LF && data.getbyte(offset) == CR # (the usual: both in this read)
              @state = :size
              offset += 2
            else
              offset = expect(data, offset, CR, :data_lf)
            end
          when :data_lf then offset = expect(data, offset, LF, :size)
          when :done then break
          when :size then offset = (@line.nil? && plain_size_line(data, offset)) || take_line(data, offset)
          else offset = take_line(data, offset)
          end
        end
        yield gathered if gathered
        offset
      end

      private

      # A size line of hex digits and CRLF, wholly in `data` from `offset`:
      # read without a String made. @return [Integer, nil] the offset after
      # its LF; nil for any other line (#take_line reads it).
      def plain_size_line(data, offset)
        at = offset
        value = 0
        while (digit = HEX[data.getbyte(at) || CR]) && at - offset <= 16 # (17 digits: #take_line refuses the line)
          value = (value << 4) | digit
          at += 1
        end
        digits = at - offset
        return unless digits.between?(1, 16) && data.getbyte(at) == CR && data.getbyte(at + 1) == LF

        chunk_size(value, digits)
        at + 2
      end

      def expect(data, offset, byte, state)
        refuse(400, "chunk data not followed by CRLF") unless data.getbyte(offset) == byte
        @state = state
        offset + 1
      end

      # Takes the rest of a size or trailer line, if it ends in `data`.
      def take_line(data, offset)
        newline = data.index("\n", offset)
        if newline.nil?
          (@line ||= +"".b) << data.byteslice(offset, data.bytesize - offset)
          check_length(@line.bytesize)
          return data.bytesize
        end

        part = data.byteslice(offset, newline - offset)
        line = @line ? @line << part : part
        @line = nil
        check_length(line.bytesize - 1)
        refuse(400, "bare LF in a chunked body") unless line.end_with?("\r")
        line = line.byteslice(0, line.bytesize - 1)
        refuse(400, "bare CR in a chunked body") if line.include?("\r")
        @state == :size ? size_line(line) : trailer_line(line)
        newline + 1
      end

      def check_length(bytes)
        if @state == :size
          refuse(400, "chunk size line over #{LINE_MAX} bytes") if bytes > LINE_MAX
        elsif @trailer_bytes + bytes > @limits.max_header_bytes
          refuse(431, "trailer section over #{@limits.max_header_bytes} bytes")
        end
      end

      def size_line(line)
        semicolon = line.index(";")
        digits = semicolon ? line.byteslice(0, semicolon).rstrip : line
        unless digits.bytesize.between?(1, 16) && digits.count("0-9A-Fa-f") == digits.bytesize &&
               (semicolon.nil? || EXTENSIONS.match?(line.byteslice(digits.bytesize, line.bytesize)))
          refuse(400, "invalid chunk size line #{line[0, 40].inspect}")
        end

        chunk_size(digits.to_i(16), line.bytesize)
      end

      # The next chunk has `size` bytes of data, framed by a size line of
      # `line_bytes` (its CRLF excluded).
      def chunk_size(size, line_bytes)
        # Its framing: the line, its CRLF and the CRLF after the data.
        @excess += line_bytes + (size.zero? ? 2 : 4) - 16 - 2 * size
        if @excess.negative?
          @excess = 0
        elsif @excess > EXCESS_MAX
          refuse(400, "chunked body framing over its data by #{@excess} bytes (long chunk extensions)")
        end
        if size.zero?
          @state = :trailer
        else
          refuse(413, "request body over #{@limits.max_body} bytes") if (@total += size) > @limits.max_body
          @left = size
          @state = :data
        end
      end

      def trailer_line(line)
        if line.empty?
          @state = :done
          return
        end

        colon = line.index(":")
        unless colon&.positive? && line.byteslice(0, colon).count(TCHAR) == colon &&
               line.count(VALUE_CTL).zero?
          refuse(400, "invalid trailer line #{line[0, 40].inspect}")
        end
        @trailer_bytes += line.bytesize + 2
        refuse(431, "more than #{@limits.max_headers} trailers") if (@trailers += 1) > @limits.max_headers
      end

      def refuse(status, message)
        raise HTTPError.new(status, message)
      end
    end
  end
end
