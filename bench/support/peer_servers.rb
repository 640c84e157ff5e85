# frozen_string_literal: true

require "open3"
require "rbconfig"
require_relative "server_process"

module NeverBlockBench
  # How bench/server.rb and bench/rails.rb start each HTTP server, one
  # process (or one cluster) each, listening on 127.0.0.1:PORT:
  #
  # - NeverBlock::Server under the main bundle (this checkout), through
  #   bench/support/neverblock_server.rb (`workers: 0`: one process, no master);
  # - Puma, Falcon, Thin, iodine and agoo under their own bundle, bench/gemfiles/servers.gemfile
  #   (gems in vendor/bundle-servers, installed by bench/run), so that the
  #   main Gemfile.lock, which CI installs, does not change;
  # - nginx (Debian's nginx-light) with a generated config: one worker, no
  #   master, a fixed 200 "Hello world\n": the hardware reference.
  #
  # Each is started with {ServerProcess} (setsid; stopped as a session).
  module PeerServers
    REPO = File.expand_path("../..", __dir__)
    GEMFILE = File.join(REPO, "bench/gemfiles/servers.gemfile")
    BUNDLE_PATH = File.join(REPO, "vendor/bundle-servers")
    NEVERBLOCK_LAUNCHER = File.join(__dir__, "neverblock_server.rb")

    module_function

    # The environment a peer server's `bundle exec` runs in: the servers
    # bundle, not the main one this script runs under, plus the selector
    # variables (Bundler.with_unbundled_env goes back to the environment as
    # it was when Bundler loaded, before Peers.use_selector set them).
    #
    # @param extra [Hash{String => String}]
    # @return [Hash{String => String, nil}]
    def bundle_env(extra = {})
      { "BUNDLE_GEMFILE" => GEMFILE, "BUNDLE_PATH" => BUNDLE_PATH, "BUNDLE_FROZEN" => "true",
        "BUNDLE_SILENCE_ROOT_WARNING" => "1", "RUBYOPT" => nil, "RUBYLIB" => nil,
        "IO_EVENT_SELECTOR" => ENV.fetch("IO_EVENT_SELECTOR", nil),
        "NEVERBLOCK_SELECTOR" => ENV.fetch("NEVERBLOCK_SELECTOR", nil) }.merge(extra)
    end

    # Runs a block with the environment Bundler found (no main-bundle
    # RUBYOPT), so that a peer's `bundle exec` sets up its own bundle.
    def unbundled(&block)
      defined?(Bundler) ? Bundler.with_unbundled_env(&block) : yield
    end

    # @return [String, nil] why the peers cannot run (nil when they can)
    def problem
      out, status = unbundled { Open3.capture2e(bundle_env, "bundle", "check") }
      return nil if status.success?

      "the peer servers' bundle is not installed (#{out.lines.last&.strip}); run the benchmark through " \
        "bench/run, which installs bench/gemfiles/servers.gemfile.lock into vendor/bundle-servers"
    rescue SystemCallError => e
      "cannot run bundle: #{e.message}"
    end

    # @return [Hash{String => String}] gem => version locked in the servers bundle
    def locked_versions
      File.read("#{GEMFILE}.lock").scan(/^    ([a-z0-9_-]+) \(([^)]+)\)$/).to_h
           .transform_values { |v| v.sub(/-x86_64-linux.*/, "") }
    rescue SystemCallError
      {}
    end

    # @return [String] "nginx/1.22.1" (or "nginx (not installed)")
    def nginx_version
      out, = Open3.capture2e("nginx", "-v")
      out[%r{nginx/[\d.]+}] || "nginx (unknown version)"
    rescue SystemCallError
      "nginx (not installed)"
    end

    # NeverBlock::Server in one process.
    # @param rackup [String] config.ru
    # @param port [Integer]
    # @param fiber_pool [Integer] requests at once
    # @param env [Hash] for the app (e.g. NB_BENCH_DB)
    # @return [ServerProcess]
    def neverblock(rackup, port:, fiber_pool: 1000, env: {}, name: "neverblock")
      # This process runs under the main bundle (bench/run: bundle exec), so a
      # child ruby inherits its RUBYOPT=-rbundler/setup and BUNDLE_GEMFILE.
      ServerProcess.start(name, [RbConfig.ruby, NEVERBLOCK_LAUNCHER, rackup, port.to_s, fiber_pool.to_s],
                          port: port, env: env)
    end

    # NeverBlock::Server in one process through the gem's own command line,
    # `neverblock serve CONFIG_RU -w 0` (exe/neverblock, this checkout).
    # @return [ServerProcess]
    def neverblock_cli(rackup, port:, fiber_pool: 1000, env: {}, name: "neverblock")
      command = [RbConfig.ruby, File.join(REPO, "exe/neverblock"), "serve", rackup, "--workers", "0",
                 "--bind", "tcp://127.0.0.1:#{port}", "--fiber-pool", fiber_pool.to_s, "--env", "production"]
      ServerProcess.start(name, command, port: port, env: env)
    end

    # Puma in single mode (workers 0) or as a cluster, production mode.
    # @param threads [String, nil] "MIN:MAX"; nil: Puma's default (0:5 on MRI)
    # @param workers [Integer] 0: single mode (one process)
    # @return [ServerProcess]
    def puma(rackup, port:, threads: nil, workers: 0, env: {}, name: "puma")
      command = ["bundle", "exec", "puma", "--environment", "production", "--bind", "tcp://127.0.0.1:#{port}"]
      command += ["--threads", threads] if threads
      command += ["--workers", workers.to_s] if workers.positive?
      start_peer(name, command + [rackup], port, { "RACK_ENV" => "production" }.merge(env))
    end

    # Falcon with one forked server process (`-n 1`; its supervisor is the
    # other process) over plain HTTP/1.1.
    # @return [ServerProcess]
    def falcon(rackup, port:, env: {}, name: "falcon")
      start_peer(name, ["bundle", "exec", "falcon", "serve", "--bind", "http://127.0.0.1:#{port}", "--count", "1",
                        "--config", rackup], port, env)
    end

    # Thin (EventMachine), one process.
    # @return [ServerProcess]
    def thin(rackup, port:, env: {}, name: "thin")
      start_peer(name, ["bundle", "exec", "thin", "start", "--address", "127.0.0.1", "--port", port.to_s,
                        "--rackup", rackup, "--environment", "production", "--quiet"], port, env)
    end

    # iodine (facil.io, C) with one worker and one thread for the app.
    # @return [ServerProcess]
    def iodine(rackup, port:, env: {}, name: "iodine")
      start_peer(name, ["bundle", "exec", "iodine", "-b", "127.0.0.1", "-p", port.to_s, "-w", "1", "-t", "1", rackup],
                 port, env)
    end

    # agoo (C) with one worker; the app runs on the thread that started it
    # (its Rack handler's thread_count 0), HTTP on agoo's own C threads.
    # @return [ServerProcess]
    def agoo(rackup, port:, env: {}, name: "agoo")
      start_peer(name, ["bundle", "exec", "agoo", "-p", port.to_s, "-w", "1", rackup], port, env)
    end

    # What nginx answers by default: 200 "Hello world\n" to every request.
    HELLO_LOCATIONS = <<~NGINX
      location / {
        default_type text/plain;
        return 200 "Hello world\\n";
      }
    NGINX

    # nginx from one process (no master, one worker's loop), logs, temp and
    # cache files in `dir`, answering as `locations` say (hello world by
    # default); `http` adds directives to the http block (an upstream, a
    # proxy_cache_path: `%{prefix}` in it is the server's own directory).
    # @param dir [String] a scratch directory (removed by the caller)
    # @return [ServerProcess]
    def nginx(port:, dir:, name: "nginx", locations: HELLO_LOCATIONS, http: "")
      prefix = File.join(dir, "nginx-#{port}")
      FileUtils.mkdir_p(prefix)
      config = File.join(prefix, "nginx.conf")
      File.write(config, <<~NGINX)
        worker_processes 1;
        daemon off;
        master_process off;
        pid #{prefix}/nginx.pid;
        error_log #{prefix}/error.log warn;
        events { worker_connections 8192; }
        http {
          access_log off;
          client_body_temp_path #{prefix}/body;
          proxy_temp_path #{prefix}/proxy;
          fastcgi_temp_path #{prefix}/fastcgi;
          uwsgi_temp_path #{prefix}/uwsgi;
          scgi_temp_path #{prefix}/scgi;
          keepalive_requests 1000000;
        #{format(http, prefix: prefix).gsub(/^/, '  ')}
          server {
            listen 127.0.0.1:#{port};
        #{locations.gsub(/^/, '    ')}
          }
        }
      NGINX
      ServerProcess.start(name, ["nginx", "-p", prefix, "-c", config], port: port)
    end

    def start_peer(name, command, port, env)
      unbundled { ServerProcess.start(name, command, port: port, env: bundle_env(env)) }
    end
  end
end
