# frozen_string_literal: true

module NeverBlock
  class Server
    class Parser < LLHttp::Delegate
      # The empty lines a client may send before a request line (RFC 9112
      # 2.2: a server SHOULD ignore at least one CRLF there, as browsers
      # once sent one after a POST body). A {Parser} takes up to
      # {MAX_EMPTY_LINES} of them before each request, whatever reads they
      # span; one more, a bare CR or a bare LF there is refused with 400.
      #
      # Empty lines begin no request: the connection still waits for its
      # next request, on the idle deadline it had (Connection's
      # #read_next_request asks {#took_empty_lines?}), so a client that
      # sends `\r\n` now and then is closed at `idle_timeout` like one that
      # sends nothing.
      #
      # Mixed into Parser, on its state (`@empty_lines`, `@empty_cr`);
      # Parser#<< calls #take_empty_lines at a message boundary.
      module EmptyLines
        # Empty lines (CRLF) taken before a request line; one more is refused.
        MAX_EMPTY_LINES = 4

        CR = 13
        LF = 10
        private_constant :CR, :LF

        # Whether `data` holds nothing but empty lines (the last one maybe
        # cut after its CR) that {#<<} would take without refusing them:
        # the connection then goes on waiting for a request.
        # @param data [String] binary.
        # @return [Boolean]
        def empty_lines_only?(data)
          # The common answer first, asked of every keep-alive connection's
          # next request: its first byte begins a request line. (A while
          # loop below, not each_byte, for the same reason: no block call,
          # no return unwinding out of one.)
          return false unless @empty_cr || data.getbyte(0) == CR
          return false if @in_message || @closed || data.empty?

          lines = @empty_lines
          cr = @empty_cr
          offset = 0
          size = data.bytesize
          while offset < size
            byte = data.getbyte(offset)
            if cr
              return false unless byte == LF && (lines += 1) <= MAX_EMPTY_LINES

              cr = false
            else
              return false unless byte == CR

              cr = true
            end
            offset += 1
          end
          true
        end

        # Takes `data` if it holds nothing but empty lines (see
        # {#empty_lines_only?}): the connection's wait for its next request
        # goes on, to the deadline it had (Connection's #read_next_request
        # asks after each read). Bytes it would refuse, or that begin a
        # request, are left to {#<<}.
        # @param data [String, Symbol, nil] what a read returned.
        # @return [Boolean] whether `data` was empty lines, taken.
        def took_empty_lines?(data)
          # The first byte's check before the call: asked of every keep-alive
          # connection's next request, whose first byte begins a request line.
          return false unless data.is_a?(String) && (@empty_cr || data.getbyte(0) == CR) && empty_lines_only?(data)

          self << data
          true
        end

        # @return [Boolean] true while nothing of the next request has been
        #   read, not even an empty line before it (see Connection's
        #   #hand_off: a sibling worker would start it afresh).
        def at_boundary?
          !@in_message && @empty_lines.zero? && !@empty_cr
        end

        private

        # Whether the byte at `offset` of `data`, between messages, belongs
        # to an empty line (or follows a CR that must end one).
        def empty_line?(data, offset)
          return true if @empty_cr

          byte = data.getbyte(offset)
          byte == CR || byte == LF
        end

        # Takes the empty lines at `offset` of `data`, between messages.
        # @return [Integer] the offset of the first byte after them (the
        #   request line's), or `data.bytesize`.
        # @raise [HTTPError] 400 for a bare CR or LF, or one line too many.
        def take_empty_lines(data, offset)
          size = data.bytesize
          while offset < size
            byte = data.getbyte(offset)
            if @empty_cr
              fail_with(400, "a bare CR before the request line") unless byte == LF
              @empty_cr = false
              if (@empty_lines += 1) > MAX_EMPTY_LINES
                fail_with(400, "more than #{MAX_EMPTY_LINES} empty lines before the request line")
              end
            elsif byte == CR
              @empty_cr = true
            elsif byte == LF
              fail_with(400, "a bare LF before the request line")
            else
              return offset
            end
            offset += 1
          end
          offset
        end
      end
    end
  end
end
