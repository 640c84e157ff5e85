#!/usr/bin/env ruby
# frozen_string_literal: true

# Lobsters (github.com/lobsters/lobsters: Rails 8.1, SQLite) in production
# under NeverBlock (`neverblock serve --preload -w 2`) and Puma (its
# config/puma.rb: 2 workers x 10 threads), each directly and behind Thruster:
# wrk -t1 -c10 on the front page, /recent and the most commented story; per
# cell the worst of --runs fresh-server runs: req/s, p50, p99, max, responses
# of 2 s or more, errors, and the server's CPU per request (thrust's too).
# Clone Lobsters outside this repository yourself (nothing here downloads it);
# --prepare sets it up in place (its Gemfile gains neverblock from /src, where
# the Ruby 3.4 chroot mounts this checkout, and thruster; database.yml;
# bundle install; db:prepare; assets; fake data, ~4 min), each step once.
#
#   bench/run --ruby 3.4-yjit lobsters --app /work/lobsters --prepare   once
#   bench/run --ruby 3.4-yjit lobsters --app /work/lobsters             -> bench/results/ruby34-yjit/lobsters.{txt,csv,svg}

require_relative "support/harness"
require "neverblock"
require_relative "support/servers"
require "net/http"
require "open3"

module NeverBlockBench
  class LobstersBench < Bench
    DEFAULTS = { app: "/work/lobsters", prepare: false, duration: 10, warmup: 3, connections: 10, workers: 2,
                 puma_threads: 10, runs: 3 }.freeze
    QUICK = { duration: 3, warmup: 1, runs: 1 }.freeze
    ONLY = %w[neverblock puma].freeze # the servers; each directly and behind thrust
    LUA = File.expand_path("support/lobsters.lua", __dir__) # max latency, responses of 2 s or more
    GEMFILE = %(\n# Added by NeverBlock's bench/lobsters.rb --prepare (not part of Lobsters):\n) +
              %(gem "neverblock", path: "/src" # the NeverBlock checkout, where its Ruby 3.4 chroot mounts it\n) +
              %(gem "thruster", "~> 0.1"\n)
    FAKE_DATA = "if Story.count < 10 then ActionMailer::Base.delivery_method = :test; Rails.application.load_tasks; " \
                "ActiveRecord::Base.transaction { FakeDataGenerator.new(100, 300, 5).generate } end"
    FACTS = <<~'RUBY' # the data's size, then the path of the story with the most comments
      puts "#{User.count} users, #{Story.count} stories, #{Comment.count} comments"
      story = Story.where(is_deleted: false, merged_story_id: nil).order(comments_count: :desc).first
      puts "/s/#{story.short_id}/#{story.title_as_slug}"
    RUBY

    def call
      @app = File.expand_path(@options[:app])
      return prepare if @options[:prepare]
      unless %w[config/application.rb storage/primary.sqlite3 public/assets].all? { |path| File.exist?(File.join(@app, path)) } &&
             File.read(File.join(@app, "Gemfile")).include?('gem "neverblock"')
        return warn("#{@app} is no prepared Lobsters; run: bench/run --ruby 3.4-yjit lobsters --app #{@app} --prepare")
      end

      data, story = in_app("bin/rails", "runner", FACTS).lines.last(2).map(&:strip)
      @pages = { "/" => "/", "/recent" => "/recent", story[%r{\A/s/\w+}] => story } # label => path
      puts header(data)
      results = Hash.new { |hash, key| hash[key] = [] }
      @options[:runs].times do |round|
        [false, true].product(@options[:only]).each do |thrust, name|
          measure(name, thrust, round).each { |key, result| results[key] << result }
        end
      end
      report(results)
    end

    private

    def prepare
      Dir.chdir(@app) do
        File.write(".ruby-version", "#{RUBY_VERSION}\n")
        File.write("Gemfile", File.read("Gemfile") + GEMFILE) unless File.read("Gemfile").include?('gem "neverblock"')
        FileUtils.cp("config/database.yml.sample", "config/database.yml") unless File.exist?("config/database.yml")
        FileUtils.mkdir_p(%w[log tmp/pids storage])
      end
      flags = File.read(File.join(@app, ".bundle/config"))[/^BUNDLE_BUILD__SQLITE3: "(.*)"$/, 1]
      in_app("bundle", "install", env: { "BUNDLE_FROZEN" => "false", "BUNDLE_BUILD__SQLITE3" => flags }, show: true)
      in_app("bin/rails", "db:prepare", "assets:precompile", show: true)
      in_app("bin/rails", "runner", FAKE_DATA, show: true)
      puts in_app("bin/rails", "runner", FACTS).lines.last(2).first
      true
    end

    # Everything in the app runs with its own bundle, in production, and with this checkout's
    # C extensions on RUBYLIB (Bundler builds none for a path gem).
    def app_env(extra = {})
      @ext ||= NeverBlockExtension.build
      { "BUNDLE_GEMFILE" => File.join(@app, "Gemfile"), "BUNDLE_PATH" => File.join(@app, "vendor/bundle"),
        "BUNDLE_WITHOUT" => "development:test", "BUNDLE_FROZEN" => "true", "RUBYOPT" => nil, "RUBYLIB" => @ext,
        "RAILS_ENV" => "production", "RACK_ENV" => "production",
        "SECRET_KEY_BASE" => "lobsters-bench-#{'0' * 64}" }.merge(extra) # required; nothing here is secret
    end

    # Runs a command in the app's directory: its output, or with `show` that output on stderr as it comes.
    def in_app(*command, env: {}, show: false)
      Bundler.with_unbundled_env do
        next system(app_env(env), *command, chdir: @app, out: $stderr, err: $stderr) || raise("#{command.first(3).join(' ')} failed") if show

        output, status = Open3.capture2e(app_env(env), *command, chdir: @app)
        status.success? ? output : raise("#{command.first(3).join(' ')} failed:\n#{output}")
      end
    end

    # A fresh server, warmed up on every page, then each page measured: { [server, page] => result }.
    def measure(name, thrust, round)
      label = thrust ? "#{name}+thrust" : name
      port = ServerProcess.free_port
      target = thrust ? ServerProcess.free_port : port
      command, env = if name == "neverblock" then [%W[neverblock serve config.ru -w #{@options[:workers]} --preload], {}]
                     else [%w[puma -C config/puma.rb], { "PUMA_WORKERS" => @options[:workers].to_s, "RAILS_MAX_THREADS" =>
                             @options[:puma_threads].to_s, "PIDFILE" => File.join(@app, "tmp/pids/puma-#{target}.pid") }]
                     end
      command = %w[bundle exec] + command + ["-b", "tcp://127.0.0.1:#{target}"]
      command = %w[bundle exec thrust] + command if thrust
      env.merge!("HTTP_PORT" => port.to_s, "TARGET_PORT" => target.to_s) if thrust
      server = Bundler.with_unbundled_env { ServerProcess.start(label, ["env", "-C", @app, *command], port: port, env: app_env(env)) }
      @pages.each_value { |path| wait_for_200(server, path) }
      @pages.each_value { |path| wrk(server, path, @options[:warmup]) }
      @pages.to_h do |page, path|
        result = wrk(server, path, @options[:duration])
        warn format("  %-17s %-10s run %d: %5.1f req/s, p99 %5.0f ms, max %5.0f ms, %d >= 2 s, %4.1f ms CPU/req, %d errors",
                    label, page, round + 1, result[:rps], result[:p99] * 1000, result[:max] * 1000, result[:slow],
                    result[:cpu] * 1000, result[:errors])
        [[label, page], result]
      end
    ensure
      server&.stop
    end

    # Until GET `path`, asked as wrk asks (no Accept: a story's page answers the bare short URL's
    # 302 only then), answers 200; thrust answers 502 while the app boots.
    def wait_for_200(server, path, timeout: 180)
      deadline = NeverBlockBench.now + timeout
      loop do
        request = Net::HTTP::Get.new(path).tap { |get| %w[accept accept-encoding].each { |header| get.delete(header) } }
        status = (Net::HTTP.start("127.0.0.1", server.port) { |http| http.request(request).code } rescue $!.class.name) # rubocop:disable Style/RescueModifier
        return sleep(1) if status == "200" # and every worker up

        raise "#{server.name} exited:\n#{server.log_tail}" if server.exited?
        raise "#{server.name}: GET #{path} answers #{status}:\n#{server.log_tail}" if NeverBlockBench.now > deadline

        sleep 0.5
      end
    end

    def wrk(server, path, duration)
      result = Wrk.run("http://127.0.0.1:#{server.port}#{path}", connections: @options[:connections], duration: duration,
                                                                 script: LUA, pid: server.pid)
      max_us, slow = result.output.match(/^lobsters: max_us (\d+) over_2s (\d+)/)&.captures&.map(&:to_i)
      raise "no lobsters line in wrk's output:\n#{result.output}" unless max_us

      { rps: result.requests_per_second, p50: result.p50, p99: result.p99, max: max_us / 1e6, slow: slow,
        errors: result.errors, cpu: result.cpu / [result.requests, 1].max }
    end

    def header(data)
      lock = File.read(File.join(@app, "Gemfile.lock")).scan(/^    ([a-z0-9_-]+) \(([\d.]+)[^)]*\)$/).to_h
      commit = IO.popen(["git", "-C", @app, "rev-parse", "--short", "HEAD"], err: File::NULL, &:read).strip
      NeverBlockBench.header(
        "Lobsters #{commit} in production mode (SQLite; #{data}): NeverBlock -w #{@options[:workers]} --preload " \
        "vs Puma #{@options[:workers]} x #{@options[:puma_threads]} threads, each directly and behind thrust",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); rails #{lock['rails']}, puma #{lock['puma']}, " \
        "thruster #{lock['thruster']}, sqlite3 #{lock['sqlite3']}",
        "#{Wrk.version} -t1 -c#{@options[:connections]} --timeout 10s keep-alive, #{@options[:duration]} s per page after " \
        "#{@options[:warmup]} s of warm-up; worst of #{@options[:runs]} runs, a fresh server each; all on this machine"
      )
    end

    def report(results)
      rows = results.map do |(label, page), runs|
        worst = ->(key, scale = 1000) { runs.map { |run| run[key] * scale }.max }
        { "server" => label, "page" => page, "req_per_s" => runs.map { |run| run[:rps] }.min.round(1),
          "p50_ms" => worst.call(:p50).round(1), "p99_ms" => worst.call(:p99).round(1), "max_ms" => worst.call(:max).round,
          "over_2s" => worst.call(:slow, 1), "errors" => runs.sum { |run| run[:errors] },
          "cpu_ms_per_req" => worst.call(:cpu).round(2), "req_per_s_runs" => NeverBlockBench.listing(runs.map { |run| run[:rps] }, 1) }
      end
      puts "\nworst of #{@options[:runs]} runs (lowest req/s, highest latencies and CPU; errors summed)\n\n" \
           "#{Table.of(rows, rows.first&.keys || [])}"
      chart = NeverBlockBench.chart("Lobsters, #{@options[:connections]} keep-alive clients, worst of #{@options[:runs]} runs")
      chart.pivot("requests/s (higher is better)", "req_per_s", by: "page", series: "server")
      chart.pivot("p99, ms (lower is better)", "p99_ms", by: "page", series: "server")
      chart.pivot("server CPU per request, ms (lower is better)", "cpu_ms_per_req", by: "page", series: "server")
      NeverBlockBench.write_results(@options[:out], "lobsters", rows, chart)
      rows.all? { |row| row["errors"].zero? }
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::LobstersBench, "lobsters") if $PROGRAM_NAME == __FILE__
