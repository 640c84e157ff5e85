# frozen_string_literal: true

require "fileutils"
require "json"
require "socket"

# A reverse proxy in front of a server under test, on 127.0.0.1, as a
# deployment has one: Debian's nginx or HAProxy, started with a config
# written to a directory of its own, keeping its connections to the server
# open across clients, and logging every request it parsed and forwarded.
# test/neverblock/server/differential_test.rb and bench/smuggling.rb put one
# in front of each server.
#
#   proxy = FrontProxy::Nginx.start(upstream_port: 9292, dir: Dir.mktmpdir)
#   # ... clients talk to 127.0.0.1:proxy.port ...
#   proxy.stop
#   proxy.forwarded # => [#<struct FrontProxy::Forwarded method="GET", target="/", body_bytes=0>, ...]
#
# Both close a client connection that has been idle for {IDLE_CLIENT}: a
# client that sent its bytes reads until the proxy closes, and so has every
# response without closing its own side first (HAProxy drops the pipelined
# requests of a client that half-closed).
class FrontProxy
  # A request the proxy sent to the server. body_bytes: the body it sent
  # (a chunked one decoded), nil when its log does not say.
  Forwarded = Struct.new(:method, :target, :body_bytes)

  IDLE_CLIENT = "100ms" # a client connection idle this long after a response is closed
  CLIENT_TIMEOUT = "2s" # a client that stops sending mid-request is dropped after this
  START_TIMEOUT = 10    # seconds
  STOP_TIMEOUT = 10     # seconds between SIGTERM and SIGKILL

  class << self
    # Starts the proxy and waits until it listens.
    # @param upstream_port [Integer] the server's port on 127.0.0.1
    # @param dir [String] where its config, logs and temporary files go (left there)
    # @return [FrontProxy]
    # @raise [RuntimeError] when it exits or does not listen in {START_TIMEOUT} seconds
    def start(upstream_port:, dir:)
      proxy = new(upstream_port, dir)
      proxy.wait_until_listening
      proxy
    rescue StandardError
      proxy&.stop
      raise
    end

    # @return [String, nil] the binary's path, nil when it is not installed
    def binary
      name = self::BINARY
      (ENV.fetch("PATH", "").split(File::PATH_SEPARATOR) | %w[/usr/sbin /sbin])
        .map { |dir| File.join(dir, name) }.find { |path| File.executable?(path) }
    end

    # @return [String] e.g. "nginx 1.22.1", or "nginx (not installed)"
    def version
      return "#{self::BINARY} (not installed)" unless binary

      output = IO.popen([binary, "-v"], err: %i[child out], &:read)
      "#{self::BINARY} #{output[/\d+\.\d+[\w.+~-]*/]}"
    end
  end

  # @return [Integer] the port clients connect to
  attr_reader :port

  def initialize(upstream_port, dir)
    @upstream_port = upstream_port
    @dir = File.join(dir, self.class::BINARY)
    FileUtils.mkdir_p(@dir)
    @port = TCPServer.open("127.0.0.1", 0) { |server| server.addr[1] }
    config = File.join(@dir, "#{self.class::BINARY}.conf")
    File.write(config, config_text)
    @pid = Process.spawn(*command(config), out: stdout_path, err: File.join(@dir, "stderr.log"), in: File::NULL, pgroup: true)
  end

  # Waits until the proxy accepts connections.
  def wait_until_listening
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + START_TIMEOUT
    until listening?
      if Process.waitpid(@pid, Process::WNOHANG)
        @pid = nil
        raise "#{self.class::BINARY} exited at start:\n#{diagnostics}"
      end
      raise "#{self.class::BINARY} did not listen within #{START_TIMEOUT} s:\n#{diagnostics}" if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline

      sleep 0.02
    end
  end

  # Stops the proxy (SIGTERM, SIGKILL after {STOP_TIMEOUT}), closing its
  # connections to the server. Idempotent.
  def stop
    return unless @pid

    signal("TERM")
    deadline = Process.clock_gettime(Process::CLOCK_MONOTONIC) + STOP_TIMEOUT
    until Process.waitpid(@pid, Process::WNOHANG)
      if Process.clock_gettime(Process::CLOCK_MONOTONIC) > deadline
        signal("KILL")
        Process.wait(@pid)
        break
      end
      sleep 0.02
    end
  ensure
    @pid = nil
  end

  # @return [Array<Forwarded>] every request the proxy sent to the server,
  #   in the order it logged them (complete once {#stop} returned)
  def forwarded
    File.exist?(log_path) ? File.foreach(log_path, mode: "rb").filter_map { |line| parse(line.chomp) } : []
  end

  # The proxy's error log (its reasons for refusing), for failure messages.
  # @return [String]
  def diagnostics
    [File.join(@dir, "stderr.log"), error_log_path].compact.uniq.select { |path| File.exist?(path) }
                                                   .map { |path| File.read(path, mode: "rb").lines.last(20).join }.join
  end

  private

  def signal(name)
    Process.kill(name, -@pid)
  rescue Errno::ESRCH
    nil
  end

  def listening?
    Socket.tcp("127.0.0.1", @port, connect_timeout: 1).close
    true
  rescue SystemCallError
    false
  end

  def stdout_path = File.join(@dir, "stdout.log")
  def error_log_path = nil

  # nginx as Debian ships it (nginx-light), in one process: HTTP/1.1 to the
  # server over kept-alive connections (an upstream `keepalive` pool), each
  # request's body read whole before it is sent (nginx's default), logged as
  # JSON with the body, so that its length is known.
  class Nginx < FrontProxy
    BINARY = "nginx"

    private

    def command(config) = [self.class.binary, "-p", @dir, "-c", config, "-e", error_log_path]
    def log_path = File.join(@dir, "access.log")
    def error_log_path = File.join(@dir, "error.log")

    def config_text
      temp = %w[client_body proxy fastcgi uwsgi scgi].map { |kind| "#{kind}_temp_path #{@dir}/#{kind}_temp;" }.join("\n  ")
      <<~NGINX
        worker_processes 1;
        daemon off;
        master_process off;
        pid #{@dir}/nginx.pid;
        error_log #{error_log_path} info;
        events { worker_connections 256; }
        http {
          #{temp}
          # $upstream_addr is empty for a request nginx answered itself.
          log_format forwarded escape=json
            '{"upstream":"$upstream_addr","status":"$status","method":"$request_method","target":"$request_uri","body":"$request_body"}';
          access_log #{log_path} forwarded;
          keepalive_timeout #{IDLE_CLIENT};
          client_header_timeout #{CLIENT_TIMEOUT};
          client_body_timeout #{CLIENT_TIMEOUT};
          client_body_buffer_size 1m; # every body in memory, where $request_body can log it
          upstream server_under_test {
            server 127.0.0.1:#{@upstream_port};
            keepalive 8;
          }
          server {
            listen 127.0.0.1:#{@port};
            location / {
              proxy_pass http://server_under_test;
              proxy_http_version 1.1;
              proxy_set_header Connection "";
              proxy_next_upstream off; # a request is sent once, or its count would not match the log's
            }
          }
        }
      NGINX
    end

    def parse(line)
      entry = JSON.parse(line)
      return if entry["upstream"].empty?

      Forwarded.new(entry["method"], entry["target"], entry["body"].bytesize)
    end
  end

  # HAProxy as Debian ships it, in HTTP mode: any idle connection to the
  # server may carry any client's next request (`http-reuse always`); each
  # request's body is waited for before it is sent (`http-buffer-request`),
  # so its length can be logged. Logs go to its stdout, one line a request:
  # server (`<NOSRV>` when not forwarded), status, method, body bytes, target.
  class HAProxy < FrontProxy
    BINARY = "haproxy"

    private

    def command(config) = [self.class.binary, "-db", "-f", config]
    def log_path = stdout_path

    def config_text
      <<~HAPROXY
        global
          log stdout len 65535 format raw local0
          tune.http.logurilen 65535 # whole targets (1024 bytes by default)
        defaults
          mode http
          log global
          timeout connect 5s
          timeout client #{CLIENT_TIMEOUT}
          timeout http-request #{CLIENT_TIMEOUT}
          timeout http-keep-alive #{IDLE_CLIENT}
          timeout server 10s
          http-reuse always
        frontend front
          bind 127.0.0.1:#{@port}
          option http-buffer-request
          http-request set-var(txn.body_bytes) req.body_len
          log-format "%s %ST %HM %[var(txn.body_bytes)] %HU"
          default_backend server_under_test
        backend server_under_test
          server server_under_test 127.0.0.1:#{@upstream_port}
      HAPROXY
    end

    def parse(line)
      server, _status, method, body_bytes, target = line.split(" ", 5)
      return if server.nil? || server == "<NOSRV>"

      Forwarded.new(method, target, body_bytes.match?(/\A\d+\z/) ? Integer(body_bytes) : nil)
    end
  end
end
