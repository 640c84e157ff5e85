#!/usr/bin/env ruby
# frozen_string_literal: true

# Request smuggling: what NeverBlock (`neverblock serve -w 0`) and Puma serve
# of test/neverblock/server/smuggling_corpus.rb's ambiguous requests (CL.TE,
# TE.CL, obfuscated Transfer-Encodings, chunk framing, bare CR and LF...),
# directly and behind nginx and HAProxy (test/support/front_proxy.rb), judged
# as the differential test judges them (test/support/smuggling_check.rb).
# Each case goes on a new connection, read until closed. A cell: ok, a refusal
# (a status, or "closed"), "proxy 400", "ok, proxy sent /smuggled", or a
# failure (served /smuggled, served unsent, incomplete, no close).
#
#   bench/run smuggling                       -> bench/results/smuggling.{txt,csv,svg}
#   bench/run smuggling --only neverblock --paths direct,haproxy

require_relative "support/harness"
require "neverblock/version"
require_relative "support/servers"
require_relative "../test/neverblock/server/smuggling_corpus"
require_relative "../test/support/front_proxy"
require_relative "../test/support/smuggling_check"

module NeverBlockBench
  class SmugglingBench < Bench
    APP = File.expand_path("support/smuggling_app.ru", __dir__)
    DEFAULTS = { paths: %w[direct nginx haproxy] }.freeze
    QUICK = {}.freeze # nothing to shrink: every case is sent once (a run takes about 2 minutes)
    ONLY = %w[neverblock puma].freeze # the servers
    PATHS = %w[direct nginx haproxy].freeze
    PROXIES = { "nginx" => FrontProxy::Nginx, "haproxy" => FrontProxy::HAProxy }.freeze
    IDLE_TIMEOUT = 120 # seconds a server keeps a proxy's idle connection: longer than a run
    DRAIN_TIMEOUT = 30 # seconds a server may take to close its connections once the clients are gone

    # @return [Boolean] true when every server and proxy ran
    def call
      paths = CommandLine.only(@options[:paths], PATHS)
      puts header
      columns = {} # "server path" => {case name => Verdict}, or a String when it could not run
      @options[:only].product(paths).each do |server, path|
        columns["#{server} #{path}"] = run(server, path)
        warn "  #{server} #{path}: #{progress(columns["#{server} #{path}"])}"
      end
      report(columns)
      columns.values.none?(String)
    end

    private

    def header
      cases = SmugglingCorpus::CASES
      NeverBlockBench.header(
        "Request smuggling: #{cases.count { |kase| !kase.control? }} ambiguous requests and " \
        "#{cases.count(&:control?)} valid ones, directly and behind a proxy",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); puma #{PeerServers.locked_versions['puma']}; " \
        "#{FrontProxy::Nginx.version}; #{FrontProxy::HAProxy.version}",
        "each case on a new connection, read until closed: directly, servers close connections idle for 1 s; " \
        "a proxy closes one idle for #{FrontProxy::IDLE_CLIENT}"
      )
    end

    # Sends every case to a fresh `server` along `path` ("direct" or a proxy's name).
    # @return [Hash{String => SmugglingCheck::Verdict}, String] the verdicts; a String when it could not run
    def run(server, path)
      proxy_class = PROXIES[path]
      return "#{proxy_class::BINARY} not installed" if proxy_class && !proxy_class.binary

      serving(server, direct: proxy_class.nil?) do |process, log|
        proxy = proxy_class&.start(upstream_port: process.port, dir: File.join(scratch, "#{server}-#{path}"))
        port = proxy ? proxy.port : process.port
        responses = SmugglingCorpus::CASES.to_h { |kase| [kase.name, SmugglingCheck.exchange(port, kase.bytes, half_close: false)] }
        proxy&.stop
        drain(process)
        SmugglingCheck.judge_all(responses, served: log.call, forwarded: proxy&.forwarded)
      ensure
        proxy&.stop
      end
    rescue StandardError => e
      "#{e.class}: #{e.message.lines.first&.strip}"
    end

    # Starts `server`, the app appending a line per request served to a log,
    # yields it and a lambda reading what that log gained since the server was
    # ready (the requests served), and stops it. `direct`: it closes a
    # connection idle for a second, the end of a case for a client that reads
    # until the server closes (Puma drops, unanswered, a connection its client
    # half-closed); behind a proxy it keeps the proxy's connections open
    # through the run (closing one as the proxy sends on it would lose a request).
    def serving(server, direct:)
      dir = File.join(scratch, "#{server}-#{direct ? 'direct' : 'proxied'}").tap { |path| FileUtils.mkdir_p(path) }
      log = File.join(dir, "served.log").tap { |path| File.write(path, "") }
      env = { "NB_SMUGGLING_LOG" => log }
      process = case server
                when "neverblock"
                  limits = direct ? "idle_timeout: 1, header_timeout: 2, body_timeout: 2" : "idle_timeout: #{IDLE_TIMEOUT}"
                  config = config_file("neverblock.rb", "limits #{limits}", dir: dir)
                  PeerServers.neverblock(APP, args: ["-w", "0", "-C", config], env: env)
                when "puma"
                  settings = direct ? "persistent_timeout 1\nfirst_data_timeout 2" : "persistent_timeout #{IDLE_TIMEOUT}"
                  PeerServers.puma(APP, config: config_file("puma.rb", settings, dir: dir), env: env)
                end
      process.serve do
        ready = File.size(log) # after the readiness check's GET /
        yield process, -> { File.binread(log, nil, ready).each_line.map { |line| served(line) } }
      end
    end

    # @return [SmugglingCheck::Served] one line of bench/support/smuggling_app.ru's log
    def served(line)
      method, rest = line.chomp.split(" ", 2)
      target, _, bytes = rest.rpartition(" ")
      SmugglingCheck::Served.new(method, target.undump, Integer(bytes))
    end

    # Waits until the server has closed every connection (none ESTABLISHED or
    # CLOSE_WAIT on its port in /proc/net/tcp): it has served all it will.
    def drain(process)
      deadline = NeverBlockBench.now + DRAIN_TIMEOUT
      local = format(":%04X", process.port)
      loop do
        open = File.readlines("/proc/net/tcp").drop(1).count do |line|
          address, _remote, state = line.split[1, 3]
          address.end_with?(local) && %w[01 08].include?(state) # ESTABLISHED, CLOSE_WAIT
        end
        return if open.zero?
        raise "#{process.name} still had #{open} connections open #{DRAIN_TIMEOUT} s after its clients left" if NeverBlockBench.now > deadline

        sleep 0.05
      end
    end

    def progress(verdicts)
      return verdicts if verdicts.is_a?(String)

      verdicts.values.map(&:label).tally.sort_by { |_, count| -count }.map { |label, count| "#{count} #{label}" }.join(", ")
    end

    def report(columns)
      cases = SmugglingCorpus::CASES.to_h { |kase| [kase.name, kase.category] }
      stray = columns.values.any? { |verdicts| verdicts.is_a?(Hash) && verdicts.key?(SmugglingCheck::NO_CASE) }
      cases[SmugglingCheck::NO_CASE] = "" if stray
      rows = cases.map do |name, category|
        { "case" => name, "category" => category }.merge(columns.transform_values { |verdicts| cell(verdicts, name) })
      end
      puts "\nwhat each server did with each case\n\n#{Table.of(rows, rows.first.keys, left: rows.first.keys)}"
      summary = columns.map { |column, verdicts| summary_row(column, verdicts) }
      summary_columns = ["server", "path", "cases", "ok", "refused", "proxy refused", "proxy sent /smuggled", "failed", "smuggled served"]
      puts "\nper server and path\n\n#{Table.of(summary, summary_columns)}"
      failures(columns)
      chart = NeverBlockBench.chart("Request smuggling: smuggled requests served that nobody sent",
                                    "#{SmugglingCorpus::CASES.size} cases (test/neverblock/server/smuggling_corpus.rb), " \
                                    "#{FrontProxy::Nginx.version}, #{FrontProxy::HAProxy.version}")
      chart.pivot("smuggled requests served (lower is better; 0 is none)", "smuggled served", by: "path", series: "server")
      NeverBlockBench.write_results(@options[:out], "smuggling", rows, chart, chart_rows: summary)
    end

    def cell(verdicts, name) = verdicts.is_a?(String) ? verdicts : verdicts[name]&.label || ""

    def summary_row(column, verdicts)
      server, path = column.split(" ", 2)
      return { "server" => server, "path" => path, "cases" => verdicts } if verdicts.is_a?(String)

      labels = verdicts.values.map(&:label)
      { "server" => server, "path" => path, "cases" => SmugglingCorpus::CASES.size,
        "ok" => labels.count("ok"), "refused" => labels.count { |label| label.match?(/\A(\d{3}|closed)\z/) },
        "proxy refused" => labels.count { |label| label.start_with?("proxy ") },
        "proxy sent /smuggled" => labels.count("ok, proxy sent /smuggled"),
        "failed" => verdicts.values.count(&:failure), "smuggled served" => verdicts.values.sum(&:smuggled) }
    end

    # Prints every failure with what was served, which the table's cells leave out.
    def failures(columns)
      lines = columns.flat_map do |column, verdicts|
        next [] if verdicts.is_a?(String)

        verdicts.filter_map { |name, verdict| "  #{column}, #{name}: #{verdict.failure}" if verdict.failure }
      end
      puts "\nfailures\n\n#{lines.empty? ? '  none' : lines.join("\n")}"
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::SmugglingBench, "smuggling") if $PROGRAM_NAME == __FILE__
