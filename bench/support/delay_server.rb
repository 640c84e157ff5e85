# frozen_string_literal: true

require "net/http"
require "socket"
require "uri"

module NeverBlockBench
  # A local HTTP/1.1 server in a child process that answers GET /delay/0.5
  # (or /anything?delay=0.5) after 0.5 s, GET / at once: the slow but endlessly
  # scalable back end of bench/client.rb and bin/demo. One thread, IO.select
  # and a list of due times (a waiting request costs an entry), and nothing
  # from NeverBlock or Async, which the client benchmark measures.
  class DelayServer
    FD_LIMIT = 65_536
    DELAY = %r{\A/delay/(\d+(?:\.\d+)?)(?:[/?]|\z)|[?&]delay=(\d+(?:\.\d+)?)(?:&|\z)}

    attr_reader :host, :port, :pid

    # Listens (before returning, so clients may connect at once), then forks the server.
    def self.start(host: "127.0.0.1", port: 0)
      listener = listen(host, port)
      lifeline, keep = IO.pipe
      pid = fork do
        keep.close
        Process.setproctitle("neverblock-bench delay server :#{listener.local_address.ip_port}")
        serve(listener, lifeline)
        exit!(0) # not the parent's at_exit handlers
      end
      port = listener.local_address.ip_port
      [listener, lifeline].each(&:close)
      new(pid, host, port, keep)
    end

    def self.listen(host, port)
      Machine.raise_fd_limit(FD_LIMIT)
      TCPServer.new(host, port).tap { |listener| listener.listen(4096) }
    end

    # Serves until `lifeline` is readable (the parent closed it or exited) or a TERM/INT; keep-alive unless asked otherwise.
    def self.serve(listener, lifeline = nil)
      stopping = false
      %w[TERM INT].each { |signal| trap(signal) { stopping = true } }
      reading = {} # socket => unparsed input
      due = [] # [time, socket, response], by time
      until stopping
        now = Process.clock_gettime(Process::CLOCK_MONOTONIC)
        while due.first && due.first[0] <= now
          _, socket, response = due.shift
          begin
            socket.write(response) # a hundred bytes: the socket's buffer takes it
            response.include?("close\r\n") ? socket.close : reading[socket] = +""
          rescue IOError, SystemCallError
            socket.close
          end
        end
        timeout = due.first ? (due.first[0] - now).clamp(0.0, 1.0) : 1.0
        ready, = IO.select(reading.keys + [listener, lifeline].compact, nil, nil, timeout)
        ready&.each do |io|
          break stopping = true if io.equal?(lifeline)
          next accept(listener, reading) if io.equal?(listener)

          chunk = io.read_nonblock(16_384, exception: false)
          next if chunk == :wait_readable
          next reading.delete(io).then { io.close } if chunk.nil?

          head = (reading[io] << chunk)[/\A(.*?)\r\n\r\n/m, 1] or next
          reading.delete(io)
          target = head[/\A\S+ (\S+)/, 1].to_s
          delay = [Float((match = DELAY.match(target)) ? match[1] || match[2] : 0), 300.0].min
          keep_alive = head.start_with?(/\S+ \S+ HTTP\/1\.0/) ? head.match?(/^connection:.*keep-alive/i) : !head.match?(/^connection:.*close/i)
          body = "delayed #{delay} s\n"
          response = "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: #{body.bytesize}\r\n" \
                     "Connection: #{keep_alive ? 'keep-alive' : 'close'}\r\n\r\n#{body}"
          entry = [now + delay, io, response]
          due.insert(due.bsearch_index { |other| other[0] > entry[0] } || due.size, entry)
        rescue IOError, SystemCallError
          reading.delete(io)
          io.close
        end
      end
    ensure
      (reading.keys + due.map { |entry| entry[1] } + [listener]).each { |io| io.close unless io.closed? } if reading
    end

    def self.accept(listener, reading)
      256.times do
        socket = listener.accept_nonblock(exception: false)
        return if socket == :wait_readable

        socket.setsockopt(Socket::IPPROTO_TCP, Socket::TCP_NODELAY, 1)
        reading[socket] = +""
      end
    rescue Errno::EMFILE, Errno::ENFILE, Errno::ECONNABORTED, Errno::EPROTO
      nil # clients wait in the accept queue, or gave up
    end

    # @return [String] the path asking for `seconds` of delay
    def self.path_for(seconds) = "/delay/#{format('%.3f', seconds)}"

    def initialize(pid, host, port, lifeline)
      @pid = pid
      @host = host
      @port = port
      @lifeline = lifeline
      owner = Process.pid
      at_exit { stop if Process.pid == owner }
    end

    def uri(path = "/") = URI("http://#{@host}:#{@port}#{path}") # bin/demo's

    # Closes the lifeline, on which the server ends within a second, and waits
    # for it. Idempotent. @return [Boolean] whether it exited cleanly
    def stop
      return @clean if @pid.nil?

      @lifeline.close
      _, status = Process.wait2(@pid)
      @pid = nil
      @clean = status.success?
    end
  end

  # The request of bench/client.rb and bin/demo: a GET over a fresh Net::HTTP
  # connection, the same work (connect, request, response, close) whatever runs it.
  module HTTPGet
    module_function

    # @return [nil, String] nil on a 200 response, else what went wrong ("HTTP 500", "Errno::ECONNRESET: ...")
    def call(host, port, path)
      # p_addr nil: never go through an http_proxy from the environment.
      response = Net::HTTP.start(host, port, nil) { |http| http.get(path) }
      response.code == "200" ? nil : "HTTP #{response.code}"
    rescue StandardError => e
      "#{e.class}: #{e.message}"
    end
  end
end
