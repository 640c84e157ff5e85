# frozen_string_literal: true

module NeverBlock
  class Server
    class Parser < LLHttp::Delegate
      # The checks a {Parser} makes on a head's bytes before llhttp sees
      # them: the request line's form and size, and the size of the header
      # block, as the head is collected ({HeadFeeding} holds a head until
      # its empty line and gives it to llhttp whole), and the blanks that
      # end a header line. Each check looks at bytes, never at how they were
      # read, so a request gets one verdict however its bytes are split.
      #
      # - The request line is `METHOD SP request-target SP HTTP-version CRLF`
      #   (RFC 9112 3): exactly two spaces, no control byte (HTAB and FF,
      #   which llhttp 8.1 takes in a target, included), a CR before its LF.
      #   Else 400.
      # - A bare CR or LF: 400, as soon as it came.
      # - A request line over `max_request_target` + {LINE_SLACK} bytes: 414,
      #   as soon as that many bytes came without its end.
      # - A header block (the head after the request line, its final empty
      #   line excluded) over `max_header_bytes`: 431, as soon as that many
      #   came. (The count llhttp's callbacks keep, of names and values,
      #   then applies too: see HeadFeeding#count_header_bytes.)
      # - A header line that begins with a blank (obs-fold): 400.
      # - An HTAB among the blanks that end a header line (OWS, RFC 9110
      #   5.6.3) is read as a space: llhttp refuses `Content-Length: 5\t`,
      #   and takes `5 `. Values lose their blanks either way.
      #
      # Mixed into Parser, on its state; called by HeadFeeding.
      module HeadForm
        # Bytes of a request line beyond its target: the longest method
        # llhttp knows (16), two spaces, `HTTP/1.1` and CRLF, rounded up.
        LINE_SLACK = 32

        # Bytes that may not appear in a request line before its CRLF.
        CONTROLS = "\x00-\x1F\x7F"

        HTAB = 9
        SPACE = 32
        CR = 13
        LF = 10
        private_constant :CONTROLS, :HTAB, :SPACE, :CR, :LF

        private

        # Checks the head collected so far (`head`, from its request line's
        # first byte), once more bytes came. Where its request line ends is
        # kept in `@line_end` (the offset of its LF; nil until it came, and
        # `@line_searched` bytes had none); how far its line ends were
        # checked, in `@ends_checked`.
        # @raise [HTTPError] 400, 414 or 431 (see the module comment).
        def check_head_form(head)
          unless @line_end
            newline = head.index("\n", @line_searched)
            line_max = @limits.max_request_target + LINE_SLACK
            fail_with(414, "request line over #{line_max} bytes") if (newline ? newline + 1 : head.bytesize) > line_max
          end
          check_line_ends(head)
          unless @line_end
            unless newline
              @line_searched = head.bytesize
              return
            end

            check_request_line(head, newline)
            @line_end = newline
          end
          # The header block: a complete head's ends with the empty line's
          # CRLF, which is not counted; an incomplete one's last two bytes
          # may be where that line begins, so they are not counted either.
          block = head.bytesize - @line_end - 3
          fail_with(431, "header block over #{@limits.max_header_bytes} bytes") if block > @limits.max_header_bytes
        end

        # Every line of a head ends in CRLF: a bare LF, or a CR before any
        # other byte, is refused as soon as it came (llhttp would refuse it
        # at the head's end, which may never come). Looks at the bytes after
        # `@ends_checked`, and leaves a CR that ends `head` to the next look.
        def check_line_ends(head)
          from = @ends_checked
          at = from
          while (at = head.index("\n", at))
            fail_with(400, "a bare LF in the head") unless at.positive? && head.getbyte(at - 1) == CR
            at += 1
          end
          last = head.bytesize - 1
          at = from
          while (at = head.index("\r", at)) && at < last
            fail_with(400, "a bare CR in the head") unless head.getbyte(at + 1) == LF
            at += 1
          end
          @ends_checked = head.getbyte(last) == CR ? last : last + 1
        end

        # `METHOD SP target SP version CRLF`, the line ending at `newline`.
        def check_request_line(head, newline)
          line = head.byteslice(0, newline)
          return if line.end_with?("\r") && line.count(" ") == 2 && line.count(CONTROLS) == 1 # (the CR)

          fail_with(400, "request line not `METHOD SP target SP version CRLF`")
        end

        # A header line that begins with a blank continues the line before
        # it (obs-fold), or sits between the request line and the first
        # header: llhttp joins the first to the value before it, and takes
        # it after an empty value (`X:\r\n b` as `X: b`), where the callbacks
        # see one fragment. Refused, as proxies may read it otherwise. (Bare
        # LFs are refused: a LF then a blank begins such a line.)
        def check_folds(head)
          return unless head.include?("\n ") || head.include?("\n\t")

          fail_with(400, "obs-fold (a header line continued on the next line)")
        end

        # Reads an HTAB among the blanks before a header line's CR as a space
        # (in place; `head` is the Parser's own copy). Linear: each run of
        # blanks is read once, however many HTABs it holds.
        def blank_trailing_tabs(head)
          at = @line_end
          while (at = head.index("\t", at + 1))
            after = at + 1
            after += 1 while (byte = head.getbyte(after)) == SPACE || byte == HTAB
            (at...after).each { |blank| head.setbyte(blank, SPACE) } if byte == CR
            at = after # every blank before `after` was read: the next search starts past them
          end
        end
      end
    end
  end
end
