# frozen_string_literal: true

module NeverBlockBench
  # One client connection of {DelayReactor}: its input buffer, the request it
  # is answering and the response still to be written.
  #
  # A connection is in one of three states:
  # :reading :: waiting for (the rest of) a request
  # :waiting :: a request is parsed; its response is due at {#due_at}
  # :writing :: the response is partly written; the socket is not writable yet
  #
  # It never reads while :waiting, so pipelined requests stay in the kernel
  # buffer and are answered in order, one delay after another.
  class DelayConnection
    # Requests may not ask for a longer delay than this, in seconds.
    MAX_DELAY = 300.0
    # Larger request heads are refused: a client that sends them is broken.
    MAX_HEAD_BYTES = 64 * 1024
    READ_CHUNK_BYTES = 16 * 1024

    DELAY_IN_PATH = %r{\A/delay/(\d+(?:\.\d+)?)(?:[/?]|\z)}
    DELAY_IN_QUERY = /[?&]delay=(\d+(?:\.\d+)?)(?:&|\z)/

    attr_reader :io, :state, :due_at

    def initialize(io)
      @io = io
      @state = :reading
      @input = +"".b
      @output = nil
      @keep_alive = false
      @due_at = nil
    end

    # Reads what the socket has and parses a request if one is complete.
    #
    # @param now [Float] monotonic clock time, seconds
    # @return [:request, :incomplete, :closed] :request when the connection
    #   moved to :waiting (see {#due_at}), :closed when the peer went away or
    #   sent garbage (the connection is closed by then)
    def on_readable(now)
      chunk = @io.read_nonblock(READ_CHUNK_BYTES, exception: false)
      return :incomplete if chunk == :wait_readable
      return close_now if chunk.nil?

      @input << chunk
      parse_request(now)
    rescue IOError, SystemCallError
      close_now
    end

    # Parses the next request already in the buffer, if there is one. Called
    # after a response was written, for pipelined requests.
    #
    # @return [:request, :incomplete, :closed]
    def parse_request(now)
      head_end = @input.index("\r\n\r\n")
      if head_end.nil?
        return @input.bytesize > MAX_HEAD_BYTES ? reject("431 Request Header Fields Too Large") : :incomplete
      end

      head = @input.byteslice(0, head_end)
      request_line, *header_lines = head.split("\r\n")
      method, target, version = request_line.to_s.split(" ", 3)
      return reject("400 Bad Request") unless method && target && version&.start_with?("HTTP/1.")

      headers = parse_headers(header_lines)
      body_bytes = Integer(headers.fetch("content-length", "0"), exception: false)
      return reject("400 Bad Request") if body_bytes.nil? || body_bytes.negative?
      return :incomplete if @input.bytesize < head_end + 4 + body_bytes

      @input = @input.byteslice(head_end + 4 + body_bytes..)
      @keep_alive = keep_alive?(version, headers["connection"])
      delay = requested_delay(target)
      @output = response("200 OK", "delayed #{delay} s\n", head: method == "HEAD")
      @due_at = now + delay
      @state = :waiting
      :request
    end

    # Writes as much of the pending response as the socket takes.
    #
    # @return [:done, :partial, :closed] :done when the response is out and
    #   the connection is :reading again (or closed, without keep-alive)
    def write_response
      @state = :writing
      while @output && !@output.empty?
        written = @io.write_nonblock(@output, exception: false)
        return :partial if written == :wait_writable

        @output = @output.byteslice(written..)
      end
      @output = nil
      return close_now unless @keep_alive

      @state = :reading
      :done
    rescue IOError, SystemCallError
      close_now
    end

    def closed?
      @state == :closed
    end

    # @return [:closed]
    def close_now
      @state = :closed
      @io.close unless @io.closed?
      :closed
    end

    private

    def parse_headers(lines)
      lines.each_with_object({}) do |line, headers|
        name, value = line.split(":", 2)
        headers[name.strip.downcase] = value.to_s.strip if name
      end
    end

    def keep_alive?(version, connection)
      connection = connection.to_s.downcase
      return connection.include?("keep-alive") if version == "HTTP/1.0"

      !connection.include?("close")
    end

    # @return [Float] seconds, from /delay/SECONDS or ?delay=SECONDS, else 0
    def requested_delay(target)
      match = DELAY_IN_PATH.match(target) || DELAY_IN_QUERY.match(target)
      match ? [Float(match[1]), MAX_DELAY].min : 0.0
    end

    # Answers an unusable request at once and closes after writing.
    def reject(status)
      @keep_alive = false
      @output = response(status, "#{status}\n")
      @due_at = 0.0
      @state = :waiting
      :request
    end

    def response(status, body, head: false)
      "HTTP/1.1 #{status}\r\n" \
        "Content-Type: text/plain\r\n" \
        "Content-Length: #{body.bytesize}\r\n" \
        "Connection: #{@keep_alive ? 'keep-alive' : 'close'}\r\n" \
        "\r\n#{body unless head}".b
    end
  end
end
