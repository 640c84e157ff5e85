# frozen_string_literal: true

require "json"
require "openssl"
require "resolv"
require "socket"
require_relative "certificates"

# Slow local servers for the compatibility matrix (test/support/compat.rb):
# each answers a request DELAY seconds after it arrived, serving many at
# once, so that only the client decides whether calls overlap. They run on
# plain threads of the test process (no fiber scheduler there), listen on
# free ports of 127.0.0.1 and stop at teardown.
module CompatServers
  # An HTTP/1.1 server: answers any request with 200 and the request's path
  # as the body (or, with a block, what the block makes of the path, as
  # `content_type`), then closes the connection. With `tls: true`, HTTPS
  # with a self-signed certificate for 127.0.0.1 (clients skip verification).
  # @return [String] its base URL, "http://127.0.0.1:PORT".
  def slow_http_server(delay: CompatMatrix::DELAY, tls: false, content_type: "text/plain", &body)
    listener = TCPServer.new("127.0.0.1", 0)
    port = listener.local_address.ip_port
    if tls
      listener = OpenSSL::SSL::SSLServer.new(listener, TestCertificates.server_context("127.0.0.1"))
      listener.start_immediately = false # the handshake runs on the connection's thread
    end
    serve(listener) do |client|
      client.accept if tls
      head = client.gets("\r\n\r\n") or next
      length = head[/^content-length:\s*(\d+)/i, 1].to_i
      client.read(length) if length.positive?
      path = head[/\A[A-Z]+ (\S+)/, 1]
      answer = body ? body.call(path) : path
      sleep delay
      client.write("HTTP/1.1 200 OK\r\nContent-Type: #{content_type}\r\nContent-Length: #{answer.bytesize}\r\n" \
                   "Connection: close\r\n\r\n#{answer}")
    end
    "#{tls ? 'https' : 'http'}://127.0.0.1:#{port}"
  end

  # An OpenAI-compatible endpoint that streams its answer: any POST gets
  # `text/event-stream` events of `tokens` tokens spread over DELAY seconds,
  # and the connection closes. To .../responses (the Responses API, which
  # RubyLLM uses) the answer comes as `response.output_text.delta` events
  # between `response.created` and `response.completed`; to anything else
  # (.../chat/completions) as `chat.completion.chunk`s whose deltas are the
  # tokens, the last with finish_reason "stop", then `data: [DONE]`. What a
  # client gem under test receives is an LLM's answer arriving token by token.
  # @return [String] its base URL, "http://127.0.0.1:PORT/v1".
  def llm_stream_server(delay: CompatMatrix::DELAY, tokens: 5)
    listener = TCPServer.new("127.0.0.1", 0)
    serve(listener) do |client|
      head = client.gets("\r\n\r\n") or next
      length = head[/^content-length:\s*(\d+)/i, 1].to_i
      client.read(length) if length.positive?
      client.write("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n" \
                   "Connection: close\r\n\r\n")
      words = Array.new(tokens) { |index| "t#{index} " }
      events = head.start_with?("POST /v1/responses") ? responses_events(words) : chat_completion_events(words)
      events.each_with_index do |event, index|
        sleep delay / tokens if index.between?(1, tokens)
        client.write(event)
      end
    end
    "http://127.0.0.1:#{listener.local_address.ip_port}/v1"
  end

  # The Responses API's stream of `words`: created, a delta each, completed.
  def responses_events(words)
    event = ->(type, fields) { "event: #{type}\ndata: #{JSON.generate({ type: type }.merge(fields))}\n\n" }
    response = { id: "resp_compat", object: "response", model: "compat-model" }
    message = { type: "message", id: "msg_compat", role: "assistant", status: "completed",
                content: [{ type: "output_text", text: words.join, annotations: [] }] }
    [event.call("response.created", response: response.merge(status: "in_progress", output: [])),
     *words.map do |word|
       event.call("response.output_text.delta", item_id: "msg_compat", output_index: 0, content_index: 0, delta: word)
     end,
     event.call("response.completed", response: response.merge(status: "completed", output: [message],
                                                              usage: { input_tokens: 1, output_tokens: words.size,
                                                                       total_tokens: words.size + 1 }))]
  end

  # The chat completions stream of `words`: a chunk each, then [DONE].
  def chat_completion_events(words)
    [*words.each_with_index.map do |word, index|
      chunk = { id: "chatcmpl-compat", object: "chat.completion.chunk", created: 0, model: "compat-model",
                choices: [{ index: 0, delta: { role: ("assistant" if index.zero?), content: word }.compact,
                            finish_reason: (index == words.size - 1 ? "stop" : nil) }] }
      "data: #{JSON.generate(chunk)}\n\n"
    end, "data: [DONE]\n\n"]
  end

  # An SMTP server that takes any message and says "250" DELAY seconds after
  # the end of its DATA.
  # @return [Integer] its port.
  def slow_smtp_server(delay: CompatMatrix::DELAY)
    listener = TCPServer.new("127.0.0.1", 0)
    serve(listener) do |client|
      client.write("220 127.0.0.1 ESMTP compat\r\n")
      while (line = client.gets("\r\n"))
        case line
        when /\A(EHLO|HELO)/i then client.write("250 127.0.0.1\r\n")
        when /\ADATA/i
          client.write("354 go ahead\r\n")
          nil until client.gets("\r\n") == ".\r\n"
          sleep delay
          client.write("250 accepted\r\n")
        when /\AQUIT/i
          client.write("221 bye\r\n")
          break
        else client.write("250 ok\r\n") # MAIL FROM, RCPT TO, RSET, NOOP
        end
      end
    end
    listener.local_address.ip_port
  end

  # A DNS server on UDP: every A question gets 10.0.0.1, DELAY seconds later
  # (any other, no record). The type of each question it was asked ("A",
  # "AAAA") is added to #dns_questions.
  # @return [Integer] its port.
  def slow_dns_server(delay: CompatMatrix::DELAY)
    socket = UDPSocket.new
    socket.bind("127.0.0.1", 0)
    thread = Thread.new do
      loop do
        packet, (_, port, host) = socket.recvfrom(512)
        Resolv::DNS::Message.decode(packet).each_question { |_, type| dns_questions << type.name.split("::").last }
        compat_threads << Thread.new do
          sleep delay
          socket.send(dns_answer(packet), 0, host, port)
        rescue IOError, Errno::EBADF
          nil # the server closed at teardown while this answer waited (seen on io_uring)
        end
      end
    rescue IOError, Errno::EBADF
      nil # closed at teardown
    end
    compat_servers << [socket, thread]
    socket.local_address.ip_port
  end

  # A TCP proxy to `host`:`port` that holds each chunk of the server's
  # answers DELAY seconds: a slow network in front of a fast server
  # (memcached has no command that waits).
  # @return [String] "127.0.0.1:PORT", its address.
  def slow_proxy(host, port, delay: CompatMatrix::DELAY)
    listener = TCPServer.new("127.0.0.1", 0)
    serve(listener) do |client|
      upstream = TCPSocket.new(host, port)
      # The client's requests go through at once; its end of the stream
      # ends the server's (memcached closes on EOF), which ends the loop below.
      forward = Thread.new do
        IO.copy_stream(client, upstream)
        upstream.close_write
      rescue IOError, SystemCallError
        nil
      end
      begin
        loop do
          chunk = upstream.readpartial(65_536)
          sleep delay
          client.write(chunk)
        end
      rescue EOFError, IOError, SystemCallError
        nil
      ensure
        upstream.close
        forward.join(1)
      end
    end
    "127.0.0.1:#{listener.local_address.ip_port}"
  end

  # Minitest hook: closes the listeners and waits for their threads.
  def after_teardown
    compat_servers.each do |listener, thread|
      listener.close
      thread.join(2)
    end
    compat_threads.each { |thread| thread.join(2) }
    super
  end

  # @return [Array<String>] the types of the questions #slow_dns_server was
  #   asked, in order.
  def dns_questions
    @dns_questions ||= []
  end

  private

  def compat_servers
    @compat_servers ||= []
  end

  def compat_threads
    @compat_threads ||= []
  end

  # Accepts connections on `listener`, each served by the block on a thread
  # of its own, which closes it afterwards.
  def serve(listener)
    thread = Thread.new do
      loop do
        client = listener.accept
        compat_threads << Thread.new do
          yield client
        rescue IOError, SystemCallError, OpenSSL::SSL::SSLError
          nil # the client went away
        ensure
          client.close
        end
      end
    rescue IOError, SystemCallError, OpenSSL::SSL::SSLError
      nil # the listener was closed at teardown
    end
    compat_servers << [listener, thread]
  end

  def dns_answer(packet)
    query = Resolv::DNS::Message.decode(packet)
    answer = Resolv::DNS::Message.new(query.id)
    answer.qr = 1
    answer.aa = 1
    answer.rd = query.rd
    answer.ra = 1
    query.each_question do |name, type|
      answer.add_question(name, type)
      answer.add_answer(name, 60, Resolv::DNS::Resource::IN::A.new("10.0.0.1")) if type == Resolv::DNS::Resource::IN::A
    end
    answer.encode
  end
end
