# frozen_string_literal: true

require "fileutils"
require "etc"
require "open3"
require "rbconfig"
require "socket"
require "tmpdir"
require_relative "ruby_description"
require_relative "../../test/support/free_port"

module NeverBlockBench
  # One HTTP server under test, in a session of its own (setsid), so that
  # stopping it stops all it forked (workers) and nothing is left listening.
  # Its output goes to a log in a directory of its own, removed by {#stop}.
  class ServerProcess
    STOP_TIMEOUT = 10 # seconds between SIGTERM and SIGKILL
    @running = []

    class << self
      # Starts `command` (argv, without setsid); not necessarily ready.
      def start(name, command, port:, env: {}) = new(name, command, port, env).tap { |server| @running << server }
      def stop_all = @running.dup.each(&:stop) # CommandLine.main does, as a script ends
      def forget(server) = @running.delete(server)
      include FreePort # free_port: a port that nothing listens on now
    end

    attr_reader :name, :port, :pid

    def initialize(name, command, port, env)
      @name = name
      @port = port
      @tmpdir = Dir.mktmpdir("neverblock-bench-#{name.gsub(/\W+/, '-')}-")
      @log = File.join(@tmpdir, "server.log")
      # The session's and process group's id is its pid: one signal reaches all it forks.
      @pid = Process.spawn(env, "setsid", *command, %i[out err] => [@log, "w"], in: File::NULL)
    end

    # Waits until a GET of `path` gets any response; raises when the process exits or `timeout` s pass.
    def wait_until_ready(path: "/", timeout: 60)
      deadline = NeverBlockBench.now + timeout
      until RawHTTP.get(@port, path, connect_timeout: 1, timeout: 5)
        raise "#{@name} exited before it answered (#{@status.inspect}):\n#{log_tail}" if exited?
        raise "#{@name} did not answer within #{timeout} s:\n#{log_tail}" if NeverBlockBench.now > deadline

        sleep 0.1
      end
    end

    # Waits until it answers, yields it, stops it.
    def serve(path: "/", timeout: 60)
      wait_until_ready(path: path, timeout: timeout)
      yield self
    ensure
      stop
    end

    # Stops the whole session (TERM, then KILL after {STOP_TIMEOUT}). Idempotent.
    def stop
      return unless @pid

      deadline = NeverBlockBench.now + STOP_TIMEOUT
      signal("TERM")
      sleep 0.05 until session_gone? || NeverBlockBench.now > deadline
      unless session_gone?
        warn "  #{@name} did not stop within #{STOP_TIMEOUT} s after SIGTERM; SIGKILL"
        signal("KILL")
        sleep 0.05 until session_gone? || NeverBlockBench.now > deadline + 5
      end
      Process.wait(@pid) unless exited?
      keep_log
      @pid = nil
      self.class.forget(self)
      FileUtils.rm_rf(@tmpdir)
    end

    # Whether the session's leader (a cluster's master) has ended; reaps it.
    def exited?
      @status ||= Process.waitpid2(@pid, Process::WNOHANG)&.last
      !@status.nil?
    end

    def log_tail(lines = 20)
      text = File.exist?(@log) ? File.read(@log).lines.last(lines).join : ""
      text.empty? ? "(no output)" : text
    end

    private

    # NEVERBLOCK_BENCH_LOGS=DIR keeps each server's log there (DIR/NAME-PID.log) when it stops.
    def keep_log
      return unless (dir = ENV.fetch("NEVERBLOCK_BENCH_LOGS", nil)) && File.exist?(@log)

      FileUtils.mkdir_p(dir)
      FileUtils.cp(@log, File.join(dir, "#{@name.gsub(/\W+/, '-')}-#{@pid}.log"))
    end

    def signal(name) = (Process.kill(name, -@pid) rescue nil) # ESRCH: all gone

    # True when no process of the session is left (the leader reaped, so a zombie does not count).
    def session_gone?
      exited?
      Process.kill(0, -@pid)
      false
    rescue Errno::ESRCH
      true
    rescue Errno::EPERM
      false
    end
  end

  # HTTP/1.1 GETs on plain sockets to 127.0.0.1, reading Content-Length or chunked responses.
  module RawHTTP
    module_function

    def request(path = "/") = "GET #{path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"

    # One GET on a new connection. @return [String, nil] the response's head; nil when refused, closed or past `timeout`
    def get(port, path = "/", connect_timeout: nil, timeout: 10)
      Socket.tcp("127.0.0.1", port, connect_timeout: connect_timeout) do |socket|
        socket.write(request(path))
        read_response(socket, NeverBlockBench.now + timeout)
      end
    rescue SystemCallError, IOError
      nil
    end

    # Reads a response's head. @return [Array(String, String), nil] the head and what followed; nil on EOF or past `deadline`
    def read_head(socket, deadline)
      data = +"".b
      data << (read_some(socket, deadline) || (return nil)) until data.include?("\r\n\r\n")
      data.split("\r\n\r\n", 2)
    end

    # Reads one response. @return [String, nil] its head, nil on EOF or past `deadline`
    def read_response(socket, deadline)
      head, body = read_head(socket, deadline) || (return nil)
      if (length = head[/^content-length:\s*(\d+)/i, 1])
        body << (read_some(socket, deadline) || (return nil)) while body.bytesize < length.to_i
      elsif head.match?(/^transfer-encoding:\s*chunked/i)
        body << (read_some(socket, deadline) || (return nil)) until body.end_with?("0\r\n\r\n")
      end
      head
    end

    # @return [String, nil] what the socket has, once it has something; nil on EOF or past `deadline`
    def read_some(socket, deadline)
      loop do
        data = socket.read_nonblock(16_384, exception: false)
        return data unless data == :wait_readable

        remaining = deadline - NeverBlockBench.now
        return nil unless remaining.positive? && socket.wait_readable(remaining)
      end
    end
  end

  # How the scripts start each server on 127.0.0.1:PORT: NeverBlock from this
  # checkout; Puma, Falcon, Thin, iodine and agoo under their own bundle,
  # bench/gemfiles/servers.gemfile (installed by bench/run; the main lock
  # stays as it is), or on Ruby 3.4 the one bench/run names
  # (NB_BENCH_PEERS_GEMFILE, _PATH); nginx with a generated config.
  module PeerServers
    REPO = File.expand_path("../..", __dir__)
    GEMFILE = ENV.fetch("NB_BENCH_PEERS_GEMFILE", File.join(REPO, "bench/gemfiles/servers.gemfile"))
    BUNDLE_PATH = ENV.fetch("NB_BENCH_PEERS_PATH", File.join(REPO, "vendor/bundle-servers"))

    module_function

    # A peer's `bundle exec` environment: the servers bundle and the selector variables.
    def bundle_env(extra = {})
      { "BUNDLE_GEMFILE" => GEMFILE, "BUNDLE_PATH" => BUNDLE_PATH,
        "BUNDLE_FROZEN" => "true", "BUNDLE_SILENCE_ROOT_WARNING" => "1", "RUBYOPT" => nil, "RUBYLIB" => nil,
        "IO_EVENT_SELECTOR" => ENV.fetch("IO_EVENT_SELECTOR", nil),
        "NEVERBLOCK_SELECTOR" => ENV.fetch("NEVERBLOCK_SELECTOR", nil) }.merge(extra)
    end

    # @return [Hash{String => String}] gem => version locked in the servers bundle
    def locked_versions
      File.read("#{GEMFILE}.lock").scan(/^    ([a-z0-9_-]+) \(([^)]+)\)$/).to_h.transform_values { |v| v.sub(/-x86_64-linux.*/, "") }
    end

    # @return [String] e.g. "nginx/1.22.1"
    def nginx_version = (Open3.capture2e("nginx", "-v").first[%r{nginx/[\d.]+}] || "nginx (unknown version)" rescue "nginx (not installed)")

    # `neverblock serve` from this checkout (or from `repo`, a worktree of
    # another revision), production mode, with `args` (default: the one process serves).
    def neverblock(rackup, port: ServerProcess.free_port, args: %w[-w 0], env: {}, name: "neverblock", repo: REPO)
      command = [RbConfig.ruby, File.join(repo, "exe/neverblock"), "serve", rackup, "-b", "tcp://127.0.0.1:#{port}",
                 "-E", "production", *args]
      ServerProcess.start(name, command, port: port, env: env)
    end

    # NeverBlock, Puma (-C `puma_config`, --threads `puma_threads`) or Falcon serving `rackup` with
    # `workers` workers, yielded once every worker is up and stopped after the block.
    def cluster(name, rackup, workers:, puma_config: nil, puma_threads: nil)
      server = case name
               when "neverblock" then neverblock(rackup, args: ["-w", workers.to_s])
               when "puma" then puma(rackup, workers: workers, threads: puma_threads, config: puma_config)
               when "falcon" then falcon(rackup, count: workers)
               else raise ArgumentError, "no cluster for #{name.inspect}"
               end
      server.serve do
        sleep 1 # every worker up
        yield server
      end
    end

    # Puma, production mode: single (workers 0) or a cluster; threads nil is Puma's default (0:5).
    def puma(rackup, port: ServerProcess.free_port, threads: nil, workers: 0, config: nil, env: {}, name: "puma")
      command = ["bundle", "exec", "puma", "--environment", "production", "--bind", "tcp://127.0.0.1:#{port}"]
      command += ["--threads", threads] if threads
      command += ["--workers", workers.to_s] if workers.positive?
      command += ["-C", config] if config
      peer(name, command + [rackup], port, { "RACK_ENV" => "production" }.merge(env))
    end

    # Falcon, production mode, HTTP/1.1: `count` forked server processes.
    def falcon(rackup, port: ServerProcess.free_port, count: 1, args: [], name: "falcon")
      peer(name, %W[bundle exec falcon serve --bind http://127.0.0.1:#{port} --count #{count}] + args + ["--config", rackup],
           port, { "RACK_ENV" => "production" })
    end

    HELLO_LOCATIONS = <<~NGINX
      location / {
        default_type text/plain;
        return 200 "Hello world\\n";
      }
    NGINX

    # nginx in one process (no master, one worker), its files under `dir`;
    # `http` adds to the http block (`%{prefix}` is the server's own directory).
    def nginx(port:, dir:, name: "nginx", locations: HELLO_LOCATIONS, http: "")
      prefix = File.join(dir, "nginx-#{port}")
      FileUtils.mkdir_p(prefix)
      temp = %w[client_body proxy fastcgi uwsgi scgi].map { |kind| "#{kind}_temp_path #{prefix}/#{kind};" }.join("\n  ")
      File.write("#{prefix}/nginx.conf", <<~NGINX)
        worker_processes 1;
        daemon off;
        master_process off;
        pid #{prefix}/nginx.pid;
        error_log #{prefix}/error.log warn;
        events { worker_connections 8192; }
        http {
          access_log off;
          #{temp}
          keepalive_requests 1000000;
        #{format(http, prefix: prefix).gsub(/^/, '  ')}
          server {
            listen 127.0.0.1:#{port};
        #{locations.gsub(/^/, '    ')}
          }
        }
      NGINX
      ServerProcess.start(name, ["nginx", "-p", prefix, "-c", "#{prefix}/nginx.conf"], port: port)
    end

    # Asks a Ruby server which Ruby serves (GET /ruby, e.g. "ruby 3.4.5 ... yjit=true") and raises unless
    # YJIT is on in it exactly when it is here (bench/run --ruby 3.4-yjit sets RUBY_YJIT_ENABLE, which a peer might lose).
    def check_ruby(server, path: "/ruby")
      require "net/http"
      answer = Net::HTTP.get(URI("http://127.0.0.1:#{server.port}#{path}")).strip
      wanted = NeverBlockBench.ruby_description[/yjit=\w+/]
      raise "#{server.name} runs #{answer.inspect}, wanted #{wanted} as in the benchmark's own Ruby" unless answer.end_with?(wanted)

      answer
    end

    def peer(name, command, port, env)
      start = -> { ServerProcess.start(name, command, port: port, env: bundle_env(env)) }
      defined?(Bundler) ? Bundler.with_unbundled_env(&start) : start.call
    end
  end

  # wrk (Debian's 4.1): requests/s, the --latency percentiles (s), errors (socket errors and non-2xx/3xx;
  # `requests` counts responses, so a request lost to a socket error is in `errors` alone) and its `output`.
  module Wrk
    Result = Struct.new(:requests_per_second, :requests, :p50, :p90, :p99, :errors, :non2xx, :error_text, :output, :cpu,
                        keyword_init: true)
    UNITS = { "us" => 1e-6, "ms" => 1e-3, "s" => 1.0, "m" => 60.0 }.freeze

    module_function

    def version = (Open3.capture2e("wrk", "--version").first[%r{wrk (?:debian/)?([\d.]+)}, 1]&.then { |v| "wrk #{v}" } rescue nil)

    # `wrk -t1 -cN -dXs --timeout Ts --latency [-s script] url`; with `pid`, the
    # result's `cpu` is the CPU seconds of that session ({ProcessCpu}) over the run.
    def run(url, connections:, duration:, timeout: 10, script: nil, pid: nil, headers: [])
      command = ["wrk", "-t1", "-c#{connections}", "-d#{duration.ceil}s", "--timeout", "#{timeout.ceil}s", "--latency"]
      command += ["-s", script] if script
      headers.each { |header| command += ["-H", header] } # "Name: value" (wrk needs the space)
      cpu = ProcessCpu.session_seconds(pid) if pid
      output, status = Open3.capture2e(*command, url)
      cpu = ProcessCpu.session_seconds(pid) - cpu if pid
      raise "#{command.join(' ')} failed (#{status}):\n#{output}" unless status.success?

      parse(output).tap { |result| result.cpu = cpu }
    end

    def parse(output)
      rate = output[%r{^Requests/sec:\s+([\d.]+)}, 1] or raise "no Requests/sec in wrk's output:\n#{output}"
      socket = output[/Socket errors: (.*)$/, 1]
      non2xx = output[/Non-2xx or 3xx responses: (\d+)/, 1].to_i
      percentile = lambda do |which|
        match = output.match(/^\s+#{which}%\s+([\d.]+)(us|ms|s|m)\b/)
        match && Float(match[1]) * UNITS.fetch(match[2])
      end
      Result.new(requests_per_second: Float(rate), requests: output[/(\d+) requests in/, 1].to_i,
                 p50: percentile.call(50), p90: percentile.call(90), p99: percentile.call(99),
                 errors: (socket ? socket.scan(/\d+/).sum(&:to_i) : 0) + non2xx, non2xx: non2xx,
                 error_text: [("socket errors: #{socket}" if socket), ("non-2xx/3xx: #{non2xx}" if non2xx.positive?)].compact.join("; "),
                 output: output)
    end
  end

  # The processes of a session (a {ServerProcess}'s workers too), from /proc.
  module ProcessCpu
    TICKS = Etc.sysconf(Etc::SC_CLK_TCK)

    # Yields /proc/PID and its stat fields after "pid (comm)" (state is [0]) of each process in `session`;
    # returns the block's values, without nil.
    def self.in_session(session)
      Dir.glob("/proc/[0-9]*/stat").filter_map do |path|
        text = File.read(path)
        stat = text[(text.rindex(")") + 2)..].split
        yield File.dirname(path), stat if Integer(stat[3]) == session
      rescue SystemCallError
        nil
      end
    end

    # CPU seconds (user + system, and of reaped children through the
    # leader's cutime/cstime) of every process in a session: steadier than
    # requests/s on a shared machine. Resolution: one tick.
    def self.session_seconds(session)
      in_session(session) { |_, stat| stat[11, 4].sum { |value| Integer(value) } }.sum.to_f / TICKS
    end
  end
end
