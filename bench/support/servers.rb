# frozen_string_literal: true

require "fileutils"
require "etc"
require "open3"
require "rbconfig"
require "socket"
require "tmpdir"

module NeverBlockBench
  # One HTTP server under test, a process in a session of its own (setsid),
  # so that stopping it stops everything it forked (Falcon's worker, Puma's
  # cluster) and nothing is left listening. Its output goes to a log in a
  # directory of its own, which lives until {#stop}.
  #
  #   server = ServerProcess.start("puma", ["bundle", "exec", "puma", ...], port: 9292)
  #   server.wait_until_ready   # GET / answered (any status)
  #   server.stop               # SIGTERM to the session, SIGKILL after 10 s
  class ServerProcess
    STOP_TIMEOUT = 10 # seconds between SIGTERM and SIGKILL
    @running = []

    class << self
      # @param command [Array<String>] argv, without setsid
      # @param env [Hash{String => String, nil}] for Process.spawn
      # @return [ServerProcess] started, not necessarily ready
      def start(name, command, port:, env: {})
        new(name, command, port, env).tap { |server| @running << server }
      end

      # Stops every server still running; for `ensure` and signal traps.
      def stop_all = @running.dup.each(&:stop)
      def forget(server) = @running.delete(server)

      # @return [Integer] a port on 127.0.0.1 that nothing listens on now
      def free_port
        TCPServer.open("127.0.0.1", 0) { |server| server.addr[1] }
      end
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

    # Waits until a GET of `path` gets any response.
    # @raise [RuntimeError] when the process exits or does not answer in `timeout` seconds
    def wait_until_ready(path: "/", timeout: 60)
      deadline = NeverBlockBench.now + timeout
      until answers?(path)
        raise "#{@name} exited before it answered (#{@status.inspect}):\n#{log_tail}" if exited?
        raise "#{@name} did not answer within #{timeout} s:\n#{log_tail}" if NeverBlockBench.now > deadline

        sleep 0.1
      end
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

    def answers?(path)
      Socket.tcp("127.0.0.1", @port, connect_timeout: 1) do |socket|
        socket.write("GET #{path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        socket.wait_readable(5) && !socket.readpartial(64).empty?
      end
    rescue SystemCallError, EOFError, IOError
      false
    end

    def signal(name)
      Process.kill(name, -@pid)
    rescue Errno::ESRCH
      nil
    end

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

  # How bench/server.rb, rails.rb, faults.rb and debounce.rb start each server,
  # listening on 127.0.0.1:PORT: NeverBlock::Server under the main bundle (this
  # checkout); Puma, Falcon, Thin, iodine and agoo under their own bundle,
  # bench/gemfiles/servers.gemfile (gems in vendor/bundle-servers, installed by
  # bench/run: run directly, a peer without it fails to start and its log says
  # why), so the main Gemfile.lock does not change; nginx with a generated
  # config as the hardware reference. On Ruby 3.4 bench/run names the 3.4 bench
  # bundle instead (NB_BENCH_PEERS_GEMFILE, NB_BENCH_PEERS_PATH), which holds the
  # peers beside NeverBlock.
  module PeerServers
    REPO = File.expand_path("../..", __dir__)
    GEMFILE = ENV.fetch("NB_BENCH_PEERS_GEMFILE", File.join(REPO, "bench/gemfiles/servers.gemfile"))
    BUNDLE_PATH = ENV.fetch("NB_BENCH_PEERS_PATH", File.join(REPO, "vendor/bundle-servers"))

    module_function

    # A peer's `bundle exec` environment: the servers bundle, plus the selector
    # variables (Bundler.with_unbundled_env restores the environment as it was
    # before Peers.use_epoll set them).
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
    def nginx_version
      Open3.capture2e("nginx", "-v").first[%r{nginx/[\d.]+}] || "nginx (unknown version)"
    rescue SystemCallError
      "nginx (not installed)"
    end

    # `neverblock serve` from this checkout, production mode, with `args`
    # added (the default: no workers, the one process serves); a child ruby
    # inherits this bundle's RUBYOPT.
    def neverblock(rackup, port:, args: %w[-w 0], env: {}, name: "neverblock")
      command = [RbConfig.ruby, File.join(REPO, "exe/neverblock"), "serve", rackup, "-b", "tcp://127.0.0.1:#{port}",
                 "-E", "production", *args]
      ServerProcess.start(name, command, port: port, env: env)
    end

    # NeverBlock ("neverblock"), Puma ("puma") or Falcon ("falcon", --count)
    # serving `rackup` with `workers` workers on a free port, yielded once
    # every worker is up and stopped after the block; `puma_config` is Puma's
    # -C file, `puma_threads` its --threads (nil: Puma's default).
    def cluster(name, rackup, workers:, puma_config: nil, puma_threads: nil)
      port = ServerProcess.free_port
      server = case name
               when "neverblock" then neverblock(rackup, port: port, args: ["-w", workers.to_s])
               when "puma" then puma(rackup, port: port, workers: workers, threads: puma_threads, config: puma_config)
               when "falcon" then falcon(rackup, port: port, count: workers)
               else raise ArgumentError, "no cluster for #{name.inspect}"
               end
      server.wait_until_ready
      sleep 1 # every worker up
      yield server
    ensure
      server&.stop
    end

    # Puma, production mode: single (workers 0) or a cluster; threads nil is
    # Puma's default (0:5); `config` a -C file.
    def puma(rackup, port:, threads: nil, workers: 0, config: nil, env: {}, name: "puma")
      command = ["bundle", "exec", "puma", "--environment", "production", "--bind", "tcp://127.0.0.1:#{port}"]
      command += ["--threads", threads] if threads
      command += ["--workers", workers.to_s] if workers.positive?
      command += ["-C", config] if config
      peer(name, command + [rackup], port, { "RACK_ENV" => "production" }.merge(env))
    end

    # Falcon, production mode, HTTP/1.1: `count` forked server processes.
    def falcon(rackup, port:, count: 1, name: "falcon")
      peer(name, %W[bundle exec falcon serve --bind http://127.0.0.1:#{port} --count #{count} --config #{rackup}],
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

    # Asks a Ruby server which Ruby serves (GET `path`, ServerApp's /ruby) and
    # raises unless YJIT is on in it exactly when it is on here: bench/run
    # --ruby 3.4-yjit turns it on for every Ruby process through
    # RUBY_YJIT_ENABLE, and a peer that lost the variable would be measured
    # on the interpreter.
    # @return [String] the server's answer, e.g. "ruby 3.4.5 ... yjit=true"
    def check_ruby(server, path: "/ruby")
      require "net/http"
      answer = Net::HTTP.get(URI("http://127.0.0.1:#{server.port}#{path}")).strip
      wanted = "yjit=#{defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled? ? true : false}"
      raise "#{server.name} runs #{answer.inspect}, wanted #{wanted} as in the benchmark's own Ruby" unless answer.end_with?(wanted)

      answer
    end

    def peer(name, command, port, env)
      start = -> { ServerProcess.start(name, command, port: port, env: bundle_env(env)) }
      defined?(Bundler) ? Bundler.with_unbundled_env(&start) : start.call
    end
  end

  # wrk (Debian's 4.1) against a URL: requests/s, the --latency percentiles
  # (seconds) and errors (socket errors and non-2xx/3xx responses). wrk's
  # `requests` counts responses only: a request lost to a socket error is
  # in `errors`, not in `requests`; a non-2xx/3xx response is in both.
  # `output` is wrk's whole text, for what a Lua script's `done` printed.
  module Wrk
    Result = Struct.new(:requests_per_second, :requests, :p50, :p90, :p99, :errors, :non2xx, :error_text, :output,
                        keyword_init: true)
    UNITS = { "us" => 1e-6, "ms" => 1e-3, "s" => 1.0, "m" => 60.0 }.freeze

    module_function

    def version
      Open3.capture2e("wrk", "--version").first[%r{wrk (?:debian/)?([\d.]+)}, 1]&.then { |v| "wrk #{v}" }
    rescue SystemCallError
      nil
    end

    # @param duration [Numeric] seconds (whole)
    # @param script [String, nil] a Lua script (-s) that shapes the requests
    # @return [Result]
    # @raise [RuntimeError] when wrk fails or prints no requests/s
    def run(url, connections:, duration:, timeout: 10, script: nil)
      command = ["wrk", "-t1", "-c#{connections}", "-d#{duration.ceil}s", "--timeout", "#{timeout.ceil}s", "--latency"]
      command += ["-s", script] if script
      output, status = Open3.capture2e(*command, url)
      raise "#{command.join(' ')} failed (#{status}):\n#{output}" unless status.success?

      parse(output)
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

  # CPU seconds (user + system) of every process in a session (a
  # {ServerProcess}'s workers and threads too, and reaped children through the
  # leader's cutime/cstime), from /proc. It stays put on a shared machine where
  # requests/s moves with every other process's load. Resolution: one tick.
  module ProcessCpu
    TICKS = Etc.sysconf(Etc::SC_CLK_TCK)

    def self.session_seconds(session)
      Dir.glob("/proc/[0-9]*/stat").sum do |path|
        text = File.read(path)
        fields = text[(text.rindex(")") + 2)..].split # after "pid (comm)": state is [0], session [3]
        Integer(fields[3]) == session ? fields[11, 4].sum { |value| Integer(value) } : 0
      rescue SystemCallError
        0
      end.to_f / TICKS
    end
  end
end
