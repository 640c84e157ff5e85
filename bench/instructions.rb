#!/usr/bin/env ruby
# frozen_string_literal: true

# Instructions per hello-world request of `neverblock serve -w 0`, counted
# by callgrind (valgrind), which counts the same on a loaded machine as on
# an idle one: wall-clock and CPU time are noisy on a shared box, this is
# not. One keep-alive client in this process sends --warmup requests, the
# server's counts are dumped (callgrind_control -d), then --requests more,
# dumped again: the second dump holds only those requests (and the event
# loop's turns between them), so startup cancels out. Only the main
# thread's instructions count: the stall detector's thread wakes on a wall
# clock, and callgrind runs so slowly that it would add what a native run
# does not spend (shown apart, "other threads"). Each revision runs
# from a git worktree of its own (its C extension built there); "head" is
# this checkout as it is, uncommitted changes included.
#
#   bench/run instructions                  -> bench/results/instructions.{txt,csv}
#   bench/run instructions --quick          100 requests a revision
#   bench/run instructions --only before,head --before 93b5567
#   bench/run instructions --app turn       every request holds its slot past
#                                           Connection::TURN: its connection's
#                                           next request waits its turn
#                                           -> bench/results/instructions-turn.{txt,csv}
#   bench/run instructions --app rails      the Rails app of bench/rails.rb, GET /fast
#                                           (in bin/databases: PostgreSQL)
#                                           -> bench/results/instructions-rails.{txt,csv}
#
# Before the counted requests the client asks the app for a full GC (GET
# /gc, hello and turn): a minor GC costs as many instructions as some
# hundred requests, and the counted stretch then has its collections at the
# same requests in every run.
#
# The client pauses --pause-ms after each response before it sends the
# next request: under callgrind the server runs some 50× slower, and a
# request sent at once would often be in the socket before the server
# looks for it, which no native client is quick enough for (natively a
# keep-alive connection finds its socket empty after each response and
# waits in the event loop). With no pause the counts leave out that wait.
#
# Needs valgrind (callgrind_control; bench/run installs it into a Ruby 3.4
# chroot). What the counts include: the server process only (the client is
# this process; for --app rails, PostgreSQL is not counted either), on the
# Ruby that runs this script: Ruby 3.1 (bench/run instructions), or with
# `bench/run --ruby 3.4-yjit instructions` Ruby 3.4 with YJIT on (its
# compiled code counts as it runs; the warm-up requests compile it) ->
# bench/results/ruby34-yjit/instructions*.{txt,csv}.

require_relative "support/harness"
require_relative "support/servers"
require_relative "support/worktrees"
require "open3"

module NeverBlockBench
  class InstructionsBench < Bench
    include Worktrees

    # What --app serves: the rackup, the path requested, the table's title,
    # `neverblock serve`'s extra arguments and environment, and the path that
    # runs a full GC (nil: the app has none).
    App = Struct.new(:rackup, :path, :title, :args, :env, :gc_path, keyword_init: true)
    APPS = {
      "hello" => App.new(rackup: File.expand_path("support/instructions_app.ru", __dir__), path: "/",
                         title: "Instructions per hello-world request", args: [], env: {}, gc_path: "/gc"),
      "turn" => App.new(rackup: File.expand_path("support/instructions_turn_app.ru", __dir__), path: "/",
                        title: "Instructions per hello-world request, each holding its request slot past Connection::TURN",
                        args: [], env: {}, gc_path: "/gc"),
      # bench/rails's app (the databases bin/databases starts: bench/run does for --app rails)
      "rails" => App.new(rackup: File.expand_path("rails/config.ru", __dir__), path: "/fast",
                         title: "Instructions per request of the Rails app's GET /fast (select 1, neverblock_postgresql)",
                         args: %w[-E production], env: { "NB_RAILS_ADAPTER" => "neverblock_postgresql", "NB_RAILS_POOL" => "200" })
    }.freeze
    DEFAULTS = { requests: 1000, warmup: 300, baseline: "1530789", before: "66bcfb0", pause_ms: 2.0, app: "hello" }.freeze
    QUICK = { requests: 100, warmup: 50 }.freeze
    ONLY = %w[baseline before head].freeze
    COLUMNS = ["revision", "commit", "requests", "instructions/request", "vs baseline", "other threads/request"].freeze
    READY_TIMEOUT = 300 # seconds: Ruby boots slowly under valgrind
    # YJIT writes machine code into memory no file maps, and patches it as
    # it runs: valgrind must look for changed code there, or it would run
    # its stale translation of the old code.
    JIT_CODE = defined?(RubyVM::YJIT) && RubyVM::YJIT.enabled? ? ["--smc-check=all-non-file"] : [].freeze
    # Run by bench/run inside a Ruby 3.4 chroot, under a bench/gemfiles bundle.
    CHROOT_BUNDLE = ENV.fetch("BUNDLE_GEMFILE", "").include?("/bench/gemfiles/")

    # @return [Boolean] true when every revision was measured
    def call
      app = APPS.fetch(@options[:app]) { raise ArgumentError, "--app is one of #{APPS.keys.join(', ')}" }
      puts NeverBlockBench.header("#{app.title} (callgrind), neverblock serve -w 0",
                                  "#{@options[:warmup]} warm-up requests, then #{@options[:requests]} counted, " \
                                  "one keep-alive connection, #{@options[:pause_ms]} ms between a response and the next request")
      rows = @options[:only].map { |name| measure(name, app) }
      base = rows.find { |row| row["revision"] == "baseline" }&.fetch("instructions/request")
      rows.each { |row| row["vs baseline"] = base ? format("%.3f", row["instructions/request"].to_f / base) : "" }
      puts "\n#{Table.of(rows, COLUMNS)}"
      NeverBlockBench.write_results(@options[:out], @options[:app] == "hello" ? "instructions" : "instructions-#{@options[:app]}", rows)
      true
    end

    private

    # @return [Hash] the row of one revision (baseline, before or head)
    def measure(name, app)
      dir = name == "head" ? REPO : checkout(@options.fetch(name.to_sym))
      commit = git(dir, "rev-parse", "--short", "HEAD") + (name == "head" && dirty? ? "+" : "")
      main, others = count(name, dir, app).map { |total| (total.to_f / @options[:requests]).round }
      warn "  #{name} (#{commit}): #{main} instructions/request"
      { "revision" => name, "commit" => commit, "requests" => @options[:requests], "instructions/request" => main,
        "other threads/request" => others }
    end

    # @return [Array(Integer, Integer)] the instructions the server's main
    #   thread and its other threads spent during the counted requests
    def count(name, dir, app)
      out = File.join(scratch, "callgrind.#{name}")
      port = ServerProcess.free_port
      server = ServerProcess.start("neverblock #{name}", [
        "valgrind", "--tool=callgrind", "--separate-threads=yes", "--callgrind-out-file=#{out}", *JIT_CODE,
        RbConfig.ruby, "-rbundler/setup", File.join(dir, "exe/neverblock"), "serve", app.rackup, "-w", "0", "-b", "tcp://127.0.0.1:#{port}", *app.args
      ], port: port, env: environment(dir).merge(app.env))
      server.wait_until_ready(timeout: READY_TIMEOUT)
      Socket.tcp("127.0.0.1", port) do |socket|
        requests(socket, @options[:warmup], app.path)
        requests(socket, 1, app.gc_path) if app.gc_path
        dump(server.pid)
        requests(socket, @options[:requests], app.path)
        dump(server.pid)
      end
      server.stop
      totals = Dir["#{out}.2-*"].sort.map { |file| Integer(File.read(file)[/^totals: (\d+)/, 1]) }
      [totals.first, totals.drop(1).sum] # "-01" is the main thread
    end

    # Sends `count` GETs on the keep-alive `socket`, one at a time, each read to its end.
    def requests(socket, count, path)
      pause = @options[:pause_ms] / 1000.0
      request = RawHTTP.request(path)
      count.times do
        sleep pause if pause.positive?
        socket.write(request)
        RawHTTP.read_response(socket, NeverBlockBench.now + READY_TIMEOUT) or raise "the server closed the connection"
      end
    end

    # Writes callgrind's counts so far to a file of their own and zeroes them.
    def dump(pid)
      output, status = Open3.capture2e("callgrind_control", "--dump", pid.to_s)
      raise "callgrind_control failed: #{output}" unless status.success?
    end

    # The revision's own lib/ and C extension, this checkout's bundle: on
    # Ruby 3.1 the revision's Gemfile over vendor/bundle; in a chroot
    # (bench/run --ruby 3.4...) this process's bench bundle, with the
    # revision's lib/ ahead of it (Worktrees#revision_env).
    def environment(dir)
      return revision_env(dir).merge("RUBYOPT" => nil) if CHROOT_BUNDLE

      { "BUNDLE_GEMFILE" => File.join(dir, "Gemfile"), "BUNDLE_PATH" => File.join(REPO, "vendor/bundle"),
        "BUNDLE_FROZEN" => "true", "RUBYLIB" => extension(dir), "RUBYOPT" => nil }
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::InstructionsBench, "instructions") if $PROGRAM_NAME == __FILE__
