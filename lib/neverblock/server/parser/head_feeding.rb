# frozen_string_literal: true

module NeverBlock
  class Server
    class Parser < LLHttp::Delegate
      # How a {Parser} gives llhttp the bytes of a head its C fast path
      # declined, and checks what llhttp reports as it goes. A head is held
      # until its empty line came, however many reads it spans (#take_head,
      # #head_end: it ends only at CRLF CRLF), checked by {HeadForm} as it
      # grows, and given to llhttp whole once complete: llhttp's verdict
      # then never depends on how the head was read. From the callbacks:
      # no obs-fold, no whitespace in a header name, and the head {Limits}
      # (`max_request_target`, `max_header_bytes`, `max_headers`), which
      # llhttp has no notion of. The headers go straight into the request's
      # env (#store_header).
      #
      # Mixed into Parser, on its state. Called from Parser#<< at a head
      # (#take_head) and by llhttp (the `on_*` callbacks, from its `<<` in
      # #feed_head); when a head ends it calls Parser#start_body, and
      # Parser#upgrade when llhttp pauses at an Upgrade or CONNECT request.
      # A refusal raises {HTTPError} through Parser#fail_with.
      module HeadFeeding
        # llhttp error names mapped to statuses other than 400.
        STATUSES = { "HPE_PAUSED_H2_UPGRADE" => 505, "HPE_INVALID_VERSION" => 505 }.freeze

        # The end of a head (strict llhttp takes no bare LF as a line end).
        HEAD_END = "\r\n\r\n"

        # The empty line that ends a head.
        CRLF = "\r\n"

        HTTP_KEYS = {} # rubocop:disable Style/MutableConstant -- a bounded cache
        private_constant :HTTP_KEYS, :HEAD_END, :CRLF

        # --- llhttp callbacks -------------------------------------------------

        # (At a head given whole: the head's clock started at its first byte, #begin_head.)
        def on_message_begin
          @url = nil
          @field = nil
          @value = nil
          @headers = @base_env.dup # the request's env: headers go straight into it
          @header_bytes = 0
          @header_count = 0
        end

        def on_url(fragment)
          @url ? @url << fragment : (@url = fragment)
          fail_with(414, "request target over #{@limits.max_request_target} bytes") if @url.bytesize > @limits.max_request_target
        end

        def on_header_field(fragment)
          @field ? @field << fragment : (@field = fragment)
          count_header_bytes(fragment)
        end

        # A head is given to llhttp whole (but its final CRLF), so a value
        # arrives in one fragment. A second one is an obs-fold continuation
        # line (`X: a\r\n b`), which llhttp joins to the value: refused, as
        # proxies may read it otherwise.
        def on_header_value(fragment)
          fail_with(400, "obs-fold (a header line continued on the next line)") if @value

          @value = fragment
          count_header_bytes(fragment)
        end

        # llhttp calls this after every value, empty ones included.
        def on_header_value_complete
          store_header
        end

        private

        # Takes the bytes of the current head from `offset`: held while its
        # end is still to come, else given to llhttp with what was held, and
        # the body's framing readied.
        # @return [Integer] the offset after what it took.
        def take_head(data, offset)
          begin_head unless @in_message
          stop = head_end(data, offset)
          unless stop
            part = data.byteslice(offset, data.bytesize - offset) # (a copy: `data` is a reused buffer)
            @held ? @held << part : @held = part
            check_head_form(@held)
            remember_tail(data, offset)
            return data.bytesize
          end

          head = data.byteslice(offset, stop - offset)
          head = @held << head if @held
          @held = nil
          @head_tail = nil
          check_head_form(head)
          check_folds(head)
          blank_trailing_tabs(head) if head.include?("\t")
          # llhttp 8.1 also ends a head at `\r\n\n` and at `\r\n\r` and any
          # byte; NeverBlock only at `\r\n\r\n`. So the empty line's CRLF is
          # fed on its own, and the head must end there (Parser#on_headers_complete).
          feed_head(head.byteslice(0, head.bytesize - 2), data, nil)
          @head_ending = true
          feed_head(CRLF, data, stop)
          @head_ending = false
          start_body(@current) if @current # (nil when llhttp completed a request without a body)
          stop
        end

        # The first byte of a request line came: the head's clock starts
        # (`header_timeout`), and the connection is in a message.
        def begin_head
          @started_at = Clock.now
          @in_message = true
          @empty_lines = 0
          @line_end = nil
          @line_searched = 0
          @ends_checked = 0
        end

        # Gives llhttp `part` of `data`; `stop` is where the head ends in `data`
        # when `part` ends it.
        def feed_head(part, data, stop)
          (@llhttp ||= LLHttp::Parser.new(self, type: :request)) << part
        rescue LLHttp::Error => e
          raise @error if @error

          name = e.message[/HPE_\w+/]
          upgrade(data, stop) if name == "HPE_PAUSED_UPGRADE" # (only ever at a head's end)
          raise HTTPError.new(STATUSES.fetch(name, 400), e.message)
        end

        # @return [Integer, nil] the offset just after the current head's empty
        #   line, nil when it does not end in `data`.
        def head_end(data, offset)
          if (tail = @head_tail)
            spanning = (tail + data.byteslice(offset, 3)).index(HEAD_END)
            return offset + spanning + 4 - tail.bytesize if spanning
          end
          found = data.index(HEAD_END, offset)
          found && found + 4
        end

        # Keeps the last three bytes of the head so far: its end may span reads.
        def remember_tail(data, offset)
          size = data.bytesize
          tail = size - offset >= 3 || @head_tail.nil? ? data.byteslice(offset, size - offset) : @head_tail + data.byteslice(offset, size - offset)
          @head_tail = tail.bytesize > 3 ? tail.byteslice(tail.bytesize - 3, 3) : tail
        end

        def count_header_bytes(fragment)
          return if (@header_bytes += fragment.bytesize + 4) <= @limits.max_header_bytes

          fail_with(431, "header block over #{@limits.max_header_bytes} bytes")
        end

        def store_header
          field = @field || +""
          value = @value || +""
          @field = @value = nil
          fail_with(431, "more than #{@limits.max_headers} headers") if (@header_count += 1) > @limits.max_headers
          # llhttp lets `Host : x` through, which a proxy might read differently: refused.
          fail_with(400, "whitespace in header name #{field.inspect}") if field.include?(" ") || field.include?("\t")
          fail_with(400, "empty header name") if field.empty?
          key = http_key(field)
          return unless key # a name with "_" could pose as one with "-": dropped, as Puma and nginx do
          return unless @headers # a trailer after a chunked body: counted above, not kept (see #on_headers_complete)

          value.strip!
          existing = @headers[key]
          @headers[key] = existing ? "#{existing}#{key == 'HTTP_COOKIE' ? '; ' : ', '}#{value}" : value
        end

        def http_key(field)
          key = HTTP_KEYS[field]
          return key if key
          return nil if field.include?("_")

          key = "HTTP_#{field.upcase.tr('-', '_')}".freeze
          key = "CONTENT_TYPE" if key == "HTTP_CONTENT_TYPE"
          key = "CONTENT_LENGTH" if key == "HTTP_CONTENT_LENGTH"
          HTTP_KEYS[field.dup.freeze] = key if HTTP_KEYS.size < 512
          key
        end
      end
    end
  end
end
