#!/usr/bin/env ruby
# frozen_string_literal: true

# A fleet drill, for the team that outgrows one machine: three hosts in network namespaces on
# a bridge (10.78.N.11-13), each a two-worker server of support/fleet_app.ru, HAProxy on
# 127.0.0.1 in front where kamal-proxy would sit (keep-alive both ways, roundrobin, health
# checks, retries only on a failed connect), Redis and a counting 1 s upstream on the bridge.
#
# Deploy: under keep-alive load (--clients threads, Net::HTTP without retries) and --streams
# server-sent event clients (--stream-seconds long streams, reconnecting as each ends), every
# host in turn is drained in HAProxy (at most --drain s for its sessions to end), restarted,
# waited for (new workers answering, and its old requests and streams ended) and put back;
# --long GET /slow?--slow and one more stream client start on each host just before its drain.
# Target: no request lost, every long request finished on its host, every stream whole (every
# event, then the last chunk), none cut, and every stream of a deployed host followed by one
# from another host. NeverBlock: HUP (hot restart), USR2
# (rolling restart) and restart; Puma 8: phased restart (USR1, no preload); Pitchfork: restart
# only (TERM to the server's processes, waiting for them to finish their requests, then start it
# again: what a team without hot restarts does; Pitchfork has no reload, its USR2 reforks the same
# code). Pitchfork serves one request per worker and closes every connection: a host's 2 workers
# serve at most 2 requests at once, so streams and long requests make the others queue.
# Herd: --herd clients at once GET /herd?KEY, round robin over the hosts, behind
# NeverBlock::Debouncer with a RedisStore all hosts share. Target: 1 upstream call.
#
#   bench/run fleet                  -> bench/results/fleet.{txt,csv,svg}
#   bench/run fleet --quick          fewer clients, a smaller herd
#   bench/run fleet --only neverblock
#
# Needs root and `ip netns` (creates the namespaces nbfN-1..3 and the bridge nbfN-0 on 10.78.N.0/24,
# N the first free slot, removed at exit), haproxy and redis-server.

require_relative "support/harness"
require "neverblock"
require_relative "support/servers"
require_relative "support/fleet"

module NeverBlockBench
  class FleetBench < Bench
    DEFAULTS = { clients: 16, long: 3, slow: 3, streams: 6, stream_seconds: 4, drain: 1.0, herd: 300 }.freeze
    QUICK = { clients: 8, long: 2, streams: 3, herd: 100 }.freeze
    ONLY = %w[neverblock puma pitchfork].freeze # the servers
    VARIANTS = { "neverblock" => %w[hup usr2 restart], "puma" => %w[phased], "pitchfork" => %w[restart] }.freeze

    # @return [Boolean] true when NeverBlock lost nothing and its herds cost one upstream call
    def call
      NeverBlockFleet.check!
      puts NeverBlockBench.header(
        "A fleet drill: 3 hosts (network namespaces), 2 workers each, HAProxy #{haproxy_version} in front; " \
        "a rolling deploy host by host under keep-alive load, and a herd through Redis",
        "neverblock #{NeverBlock::VERSION} (#{Checkout.description}); puma #{PeerServers.locked_versions['puma']} " \
        "(threads 16, no preload); pitchfork #{PeerServers.locked_versions['pitchfork']} (one request per worker); redis #{`redis-server --version`[/v=(\S+)/, 1]}",
        "load: #{@options[:clients]} keep-alive clients; #{@options[:long]} GET /slow?#{@options[:slow]} per host " \
        "before its drain; #{@options[:streams]} SSE clients, #{@options[:stream_seconds]} s streams; drain wait " \
        "at most #{@options[:drain]} s; herd: #{@options[:herd]} clients, a 1 s upstream; all on one machine"
      )
      rows = @options[:only].flat_map { |server| VARIANTS.fetch(server).map { |variant| row(server, variant) } }
      report(rows)
      rows.select { |row| row["server"] == "neverblock" }.all? do |row|
        row["lost"].zero? && row["sse_cut"].zero? && row["sse_deployed"].positive? && row["sse_stayed"].zero? && row["herd_calls"] == 1
      end
    rescue NeverBlockFleet::Unavailable => e
      abort "bench/fleet.rb cannot run here: #{e.message}"
    end

    private

    def row(server, variant)
      warn "#{server}, #{variant}: starting the fleet"
      fleet = NeverBlockFleet::Fleet.new(server: server, peers: peers_env)
      fleet.start
      drill = NeverBlockFleet.drill(fleet, variant: variant, **@options.slice(:clients, :long, :slow, :streams, :stream_seconds, :drain))
      herd = NeverBlockFleet.herd(fleet, @options[:herd])
      warn "  #{drill.inspect}\n  herd: #{herd.inspect}"
      { "server" => server, "variant" => variant, "requests" => drill[:requests], "lost" => drill[:lost],
        "notes" => [*drill[:errors].map { |error, count| "#{error} #{count}" }, *drill[:stayed]].join("; "),
        "long_finished" => "#{drill[:long_finished]}/#{drill[:long]}", "sse_clean" => drill[:clean],
        "sse_cut" => drill[:cut], "sse_moved" => "#{drill[:moved]}/#{drill[:deployed]}",
        "sse_deployed" => drill[:deployed], "sse_stayed" => drill[:stayed].size, "sse_reconnects" => drill[:reconnects],
        "sessions_left" => drill[:sessions_left],
        "herd_calls" => herd[:calls], "herd_answered" => "#{herd[:answered]}/#{@options[:herd]}",
        "deploy_s" => drill[:deploy_seconds].round(1) }
    ensure
      fleet&.stop
    end

    # Puma and Pitchfork run under the servers bundle; fleet_app.ru loads NeverBlock's lib/ and redis-client from these.
    def peers_env
      gems = %w[redis-client connection_pool].flat_map { |name| Gem::Specification.find_by_name(name).full_require_paths }
      load_path = [File.expand_path("../lib", __dir__), *ENV.fetch("RUBYLIB", "").split(":").reject(&:empty?), *gems]
      PeerServers.bundle_env("RACK_ENV" => "production", "NB_FLEET_LOAD_PATH" => load_path.join(":"),
                             "BUNDLER_SETUP" => nil, "BUNDLE_BIN_PATH" => nil)
    end

    def haproxy_version = `haproxy -v`[/version (\S+)/, 1]

    def report(rows)
      columns = %w[server variant requests lost long_finished sse_clean sse_cut sse_moved sse_reconnects herd_calls herd_answered
                   deploy_s sessions_left notes]
      puts "\n#{Table.of(rows, columns, left: %w[variant notes])}"
      puts "\nlost: requests without a 2xx answer (HAProxy retries a failed connect only); long_finished: answered by the " \
           "host they started on; sse_cut: streams closed before their last chunk or an event short; sse_moved: streams on a " \
           "host when it left the balancer whose client's next stream came from another host (one that came from it while it " \
           "was still out is named in notes); sessions_left: sessions on the " \
           "drained hosts when each restart began; notes: errors the load clients saw; herd_calls: upstream calls for one herd (target 1)"
      chart = NeverBlockBench.chart("A rolling deploy of a 3-host fleet behind HAProxy, and a herd through Redis")
      measured = rows.map { |row| row.merge("cell" => "#{row['server']} #{row['variant']}") }
      chart.pivot("requests lost during the deploy (target 0)", "lost", series: "cell")
      chart.pivot("SSE streams cut (target 0)", "sse_cut", series: "cell")
      chart.pivot("upstream calls for one herd (target 1)", "herd_calls", series: "cell")
      NeverBlockBench.write_results(@options[:out], "fleet", rows, chart, chart_rows: measured)
    end
  end
end

NeverBlockBench::CommandLine.main(NeverBlockBench::FleetBench, "fleet") if $PROGRAM_NAME == __FILE__
