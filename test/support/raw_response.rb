# frozen_string_literal: true

# Reads one HTTP/1.1 response from a socket, as the server tests and the
# compaction test's child (a script without Minitest) read them.
module RawResponse
  module_function

  # @param socket [IO]
  # @param head [Boolean] whether it answers a HEAD request (no body follows).
  # @return [Array(Integer, Hash{String => String}, String)] the status, the
  #   headers (lowercase names; a repeated one's values joined by "\n") and
  #   the body (de-chunked).
  # @raise [RuntimeError] when the connection closes before the head ends.
  def read(socket, head: false)
    status_line = socket.gets("\r\n")
    raise "connection closed before a response" unless status_line

    status = Integer(status_line[%r{\AHTTP/1\.1 (\d{3}) }, 1])
    headers = {}
    while (line = socket.gets("\r\n")) != "\r\n"
      raise "connection closed in the response's head" unless line

      key, value = line.chomp("\r\n").split(": ", 2)
      headers[key.downcase] = headers.key?(key.downcase) ? "#{headers[key.downcase]}\n#{value}" : value
    end
    [status, headers, body(socket, status, headers, head)]
  end

  # @param body [String] a whole chunked body as sent (from the first chunk's
  #   size line on).
  # @return [String] its chunks joined, up to the last (empty) one.
  def dechunk(body)
    out = +""
    until body.empty?
      size, rest = body.split("\r\n", 2)
      size = Integer(size, 16)
      break if size.zero?

      out << rest.byteslice(0, size)
      body = rest.byteslice(size + 2..)
    end
    out
  end

  def body(socket, status, headers, head)
    if head || status == 204 || status == 304 || status < 200
      +""
    elsif headers["transfer-encoding"] == "chunked"
      body = +""
      while (size = Integer(socket.gets("\r\n").chomp("\r\n"), 16)).positive?
        body << socket.read(size)
        socket.read(2)
      end
      socket.read(2)
      body
    elsif headers["content-length"]
      socket.read(Integer(headers["content-length"]))
    else
      socket.read
    end
  end
  private_class_method :body
end
