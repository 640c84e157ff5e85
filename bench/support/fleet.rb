# frozen_string_literal: true

require "fileutils"
require "net/http"
require "rbconfig"
require "socket"
require "tmpdir"
require_relative "../../test/support/free_port"

# A fleet on one machine, for bench/fleet.rb and test/neverblock/server/fleet_test.rb (stdlib
# only, so that both load it): hosts in network namespaces on a bridge, each a two-worker server
# of support/fleet_app.ru on HOST:8080; Redis and a counting upstream on the bridge's address;
# HAProxy on 127.0.0.1 in front, drained and readied through its runtime API. Linux, as root.
#
# Each fleet's names and subnet are its own: slot N (the first free of SLOTS) gives the
# namespaces nbfN-1..nbfN-3, the bridge nbfN-0 and the subnet 10.78.N.0/24. A fleet holds its slot by
# binding the abstract Unix socket "neverblock-fleet-N", which the kernel releases when the process
# ends, killed or not. Abstract sockets belong to the network namespace, which bin/test's chroots
# share with the machine, so fleets that run at once (the passes of bin/test --all, a benchmark)
# never share a name or a subnet, and a fleet may remove what a killed one left in its slot.
module NeverBlockFleet
  APP = File.expand_path("fleet_app.ru", __dir__)
  UPSTREAM_APP = File.expand_path("debounce_upstream.ru", __dir__)
  EXE = File.expand_path("../../exe/neverblock", __dir__)
  PORT = 8080 # each host's, on its own address
  # What a server is told to restart host by host; "restart" instead stops it (TERM to all its
  # processes, as `systemctl restart` does) and starts it again.
  SIGNALS = { "hup" => "HUP", "usr2" => "USR2", "phased" => "USR1" }.freeze
  SLOTS = 100
  # At most this long a deployed host stays out of the balancer after its restart, for the
  # requests and streams its old processes still serve to end.
  SETTLE = 30
  # Seconds a host stays out after its last session ended.
  RECONNECT = 1

  # Why the fleet cannot run here (not root, no `ip netns`, a missing command).
  class Unavailable < StandardError; end

  def self.now = Process.clock_gettime(Process::CLOCK_MONOTONIC)

  # Waits until the block is truthy; false after `timeout` seconds.
  def self.wait_for(timeout, interval: 0.05)
    deadline = now + timeout
    until (value = yield)
      return false if now > deadline

      sleep interval
    end
    value
  end

  # @raise [Unavailable] unless namespaces can be made and haproxy and redis-server are there
  def self.check!
    raise Unavailable, "needs root for network namespaces (euid #{Process.euid})" unless Process.euid.zero?

    %w[ip haproxy redis-server].each do |command|
      system("command -v #{command} >/dev/null 2>&1") or raise Unavailable, "no #{command} on the PATH"
    end
    probe = "nbprobe#{Process.pid}"
    probe!("ip", "netns", "add", probe)
    probe!("ip", "netns", "exec", probe, "true")
  ensure
    system("ip", "netns", "del", probe, %i[out err] => File::NULL) if probe
  end

  # Runs `command`; raises Unavailable with what it printed unless it succeeds.
  def self.probe!(*command)
    output = IO.popen(command, err: %i[child out], &:read)
    Process.last_status.success? or raise Unavailable, "`#{command.join(' ')}` fails here: #{output.strip}"
  end

  # Claims the first free slot. @return [Array(Integer, UNIXServer)] the slot and the socket that holds it
  def self.claim_slot
    SLOTS.times do |slot|
      return [slot, UNIXServer.new("\0neverblock-fleet-#{slot}")]
    rescue Errno::EADDRINUSE
      next
    end
    raise Unavailable, "all #{SLOTS} fleet slots are taken"
  end

  # A process in a session of its own (setsid): a signal to the session reaches all it forked.
  class Child
    attr_reader :pid, :log

    def initialize(command, log:, env: {})
      @log = log
      @pid = Process.spawn(env, "setsid", *command, %i[out err] => [log, "a"], in: File::NULL)
    end

    def signal(name) = Process.kill(name, @pid)

    # The pids whose parent is this process (a cluster's workers).
    def children
      Dir.glob("/proc/[0-9]*/stat").filter_map do |path|
        stat = File.read(path) rescue next # rubocop:disable Style/RescueModifier -- it exited
        Integer(File.basename(File.dirname(path))) if Integer(stat[(stat.rindex(")") + 2)..].split[1]) == @pid
      end
    end

    # TERM to the session, KILL after 10 s; reaps the leader. Idempotent.
    def stop
      return unless @pid

      group("TERM")
      NeverBlockFleet.wait_for(10) { session_gone? } || (group("KILL") && NeverBlockFleet.wait_for(5) { session_gone? })
      @pid = nil
    end

    private

    def group(name) = (Process.kill(name, -@pid) rescue true) # rubocop:disable Style/RescueModifier -- all gone

    def session_gone?
      @reaped ||= (Process.waitpid(@pid, Process::WNOHANG) rescue true) # rubocop:disable Style/RescueModifier -- reaped
      !(Process.kill(0, -@pid) rescue false) # rubocop:disable Style/RescueModifier -- ESRCH: none left
    end
  end

  # The fleet. #start builds it, #stop takes all of it down (idempotent; call it in an ensure).
  class Fleet
    include FreePort
    attr_reader :server, :hosts, :port, :dir, :sse_rate

    # @param server [String] "neverblock", "puma" or "pitchfork"
    # Names: the namespaces PREFIX1..PREFIXn, the bridge PREFIX0, where PREFIX is nbfN- for slot N
    # (NeverBlockFleet.claim_slot). Addresses on SUBNET (10.78.N.0/24): the bridge is .1, host i is .(10 + i).
    # @param peers [Hash] for Puma and Pitchfork: the bundle environment to run it under (bench/support/servers.rb)
    def initialize(server: "neverblock", hosts: 3, workers: 2, upstream_delay: 1.0, sse_rate: 5, peers: {})
      @server, @count, @workers = server, hosts, workers
      @upstream_delay, @sse_rate, @peers = upstream_delay, sse_rate, peers
      @hosts = Array.new(hosts) { |i| "host#{i + 1}" }
      @children = {}
      @dir = Dir.mktmpdir("neverblock-fleet-")
    end

    def gateway = "#{@subnet}.1"
    def address(host) = "#{@subnet}.#{10 + Integer(host[/\d+/])}"
    def namespace(host) = "#{@prefix}#{host[/\d+/]}"
    def url(path) = "http://127.0.0.1:#{@port}#{path}"

    def start
      @slot, @slot_lock = NeverBlockFleet.claim_slot
      @prefix, @subnet = "nbf#{@slot}-", "10.78.#{@slot}"
      network_up
      @redis_port, @upstream_port, @port = Array.new(3) { free_port }
      @children[:redis] = Child.new(["redis-server", "--bind", gateway, "--port", @redis_port.to_s, "--save", "",
                                     "--appendonly", "no", "--protected-mode", "no"], log: log("redis"))
      @children[:upstream] = Child.new([RbConfig.ruby, EXE, "serve", UPSTREAM_APP, "-b", "tcp://#{gateway}:#{@upstream_port}", "-w", "0"],
                                       log: log("upstream"), env: { "NB_BENCH_DELAY" => @upstream_delay.to_s })
      @hosts.each { |host| @children[host] = start_server(host) }
      ready?(gateway, @upstream_port, "/count") or raise "the upstream did not answer:\n#{tail('upstream')}"
      @hosts.each { |host| ready?(address(host), PORT) or raise "#{host} did not answer:\n#{tail(host)}" }
      @children[:haproxy] = Child.new(["haproxy", "-db", "-f", haproxy_config], log: log("haproxy"))
      ready?("127.0.0.1", @port) or raise "HAProxy did not answer:\n#{tail('haproxy')}"
      self
    end

    def stop
      @children.values.reverse_each(&:stop)
      @children.clear
      network_down if @slot_lock
      @slot_lock&.close
      @slot_lock = nil
      FileUtils.rm_rf(@dir)
    end

    # One host out of the balancer, restarted with `variant` (SIGNALS, or "restart"), back in. Waits at most
    # `drain` seconds for its sessions in HAProxy to end before the restart (long requests and streams may
    # still run), and after it until they ended (at most SETTLE seconds): the host's streams end while it is
    # out, so their clients reconnect to another host.
    # @return [Hash] :host, :sessions left when the restart began, :out and :in (monotonic clock: left the
    #   balancer, back in), :seconds the host was out
    def deploy(host, variant, drain:)
      out = NeverBlockFleet.now
      admin("set server hosts/#{host} state drain")
      NeverBlockFleet.wait_for(drain, interval: 0.1) { sessions(host).zero? }
      left = sessions(host)
      variant == "restart" ? restart(host) : reload(host, variant)
      NeverBlockFleet.wait_for(SETTLE, interval: 0.1) { sessions(host).zero? }
      sleep RECONNECT # the clients of the streams that just ended reconnect while it is still out
      admin("set server hosts/#{host} state ready")
      back = NeverBlockFleet.now
      { host: host, sessions: left, out: out, in: back, seconds: back - out }
    end

    # @return [Integer] requests the upstream got since the last call (it counts, and resets on reading)
    def upstream_calls = Integer(Net::HTTP.get(URI("http://#{gateway}:#{@upstream_port}/count")))

    # @return [Integer] the most requests the upstream served at once since the last call (it resets on reading)
    def upstream_most = Integer(Net::HTTP.get(URI("http://#{gateway}:#{@upstream_port}/most")))

    # @return [Integer] the host's current sessions in HAProxy (`show stat`'s scur)
    def sessions(host)
      rows = admin("show stat").lines.map { |line| line.split(",") }
      Integer(rows.find { |row| row[0] == "hosts" && row[1] == host }&.at(4) || 0)
    end

    # A command on HAProxy's runtime API. @return [String] its answer
    def admin(command)
      UNIXSocket.open(File.join(@dir, "haproxy.sock")) do |socket|
        socket.write("#{command}\n")
        socket.read
      end
    end

    # HAProxy's log lines of requests that did not end well: a status other than 2xx, or termination
    # flags other than "--" (who ended the session and in which phase: HAProxy's "session state at
    # disconnection"). @return [String]
    def haproxy_failures(lines = 20)
      failed = File.readlines(log("haproxy")).select do |line|
        fields = line.split
        fields.size > 9 && fields[5].match?(/\A-?\d+\z/) && (!fields[5].start_with?("2") || !fields[9].start_with?("--"))
      end
      failed.last(lines).join
    rescue Errno::ENOENT
      "(no log)"
    end

    def tail(name, lines = 15) = (File.readlines(log(name)).last(lines).join rescue "(no log)") # rubocop:disable Style/RescueModifier

    private

    def log(name) = File.join(@dir, "#{name}.log")

    def start_server(host) = Child.new(["ip", "netns", "exec", namespace(host), *server_command(host)], log: log(host), env: host_env(host))

    # Signals the host's server to restart itself; waits until new workers answer.
    def reload(host, variant)
      master = @children.fetch(host)
      old = master.children
      master.signal(SIGNALS.fetch(variant))
      NeverBlockFleet.wait_for(60, interval: 0.1) { (master.children - old).size >= @workers && new_worker_answers?(host, old) } or
        raise "#{host} did not restart with #{variant} in 60 s:\n#{tail(host)}"
    end

    # Stops the host's server (it finishes its requests first, Child#stop) and starts it again.
    def restart(host)
      @children.fetch(host).stop
      @children[host] = start_server(host)
      ready?(address(host), PORT) or raise "#{host} did not start again in 60 s:\n#{tail(host)}"
    end

    def ip(*args) = system("ip", *args, %i[out err] => File::NULL)

    def network_up
      network_down # what a killed run left
      bridge = "#{@prefix}0"
      ip("link", "add", bridge, "type", "bridge") or raise Unavailable, "cannot add the bridge #{bridge}"
      ip("addr", "add", "#{gateway}/24", "dev", bridge)
      ip("link", "set", bridge, "up")
      @hosts.each do |host|
        ns = namespace(host)
        ip("netns", "add", ns) or raise Unavailable, "`ip netns add #{ns}` failed"
        ip("link", "add", "#{ns}v", "type", "veth", "peer", "name", "eth0", "netns", ns) or raise "cannot add a veth pair for #{ns}"
        ip("link", "set", "#{ns}v", "master", bridge, "up")
        ip("-n", ns, "addr", "add", "#{address(host)}/24", "dev", "eth0")
        ip("-n", ns, "link", "set", "eth0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
      end
    end

    # Deleting either end of a veth pair deletes the pair (a namespace that another mount namespace, e.g. a
    # chroot's, still names keeps its end: hence the explicit link del). Processes still in a namespace of
    # this slot (the servers of a run killed with SIGKILL) are killed first.
    def network_down
      @hosts.each do |host|
        IO.popen(["ip", "netns", "pids", namespace(host), { err: File::NULL }], &:read).split.each do |pid|
          Process.kill("KILL", Integer(pid))
        rescue Errno::ESRCH
          nil
        end
        ip("netns", "del", namespace(host))
        ip("link", "del", "#{namespace(host)}v")
      end
      ip("link", "del", "#{@prefix}0")
    end

    def server_command(host)
      case @server
      when "neverblock"
        [RbConfig.ruby, EXE, "serve", APP, "-b", "tcp://0.0.0.0:#{PORT}", "-w", @workers.to_s, "-E", "production"]
      when "puma"
        config = File.join(@dir, "puma.rb")
        File.write(config, "workers #{@workers}\nthreads 16, 16\npreload_app! false\nbind 'tcp://0.0.0.0:#{PORT}'\n")
        ["bundle", "exec", "puma", "--environment", "production", "-C", config, APP]
      when "pitchfork"
        config = File.join(@dir, "pitchfork.rb")
        File.write(config, "worker_processes #{@workers}\nlisten '0.0.0.0:#{PORT}'\n")
        ["bundle", "exec", "pitchfork", "-E", "production", "-c", config, APP]
      else raise ArgumentError, "no fleet for #{@server.inspect}"
      end
    end

    def host_env(host)
      env = { "NB_FLEET_HOST" => host, "NB_FLEET_REDIS" => "redis://#{gateway}:#{@redis_port}/0",
              "NB_FLEET_UPSTREAM" => "http://#{gateway}:#{@upstream_port}", "NB_FLEET_SSE_RATE" => @sse_rate.to_s }
      @server == "neverblock" ? env : env.merge(@peers)
    end

    def haproxy_config
      servers = @hosts.map { |host| "  server #{host} #{address(host)}:#{PORT} check inter 1s" }
      routes = @hosts.map { |host| "  use-server #{host} if { req.hdr(x-fleet-host) -m str #{host} }" }
      File.join(@dir, "haproxy.cfg").tap { |path| File.write(path, <<~CFG) }
        global
          stats socket #{@dir}/haproxy.sock level admin
          maxconn 4096
          log stdout format raw local0
        defaults
          mode http
          log global
          option httplog
          option http-keep-alive
          timeout connect 2s
          timeout client 60s
          timeout server 60s
          timeout http-keep-alive 10s
          retries 3
        frontend fleet
          bind 127.0.0.1:#{@port}
          default_backend hosts
        backend hosts
          balance roundrobin
          http-reuse safe
          option httpchk GET /
        #{(routes + servers).join("\n")}
      CFG
    end

    def ready?(host, port, path = "/")
      NeverBlockFleet.wait_for(60, interval: 0.1) do
        Net::HTTP.start(host, port, open_timeout: 1, read_timeout: 5) { |http| http.get(path).code == "200" }
      rescue SystemCallError, IOError, Net::OpenTimeout, Net::ReadTimeout
        false
      end
    end

    # Whether a new connection to the host is answered by a worker not in `old` (pids).
    def new_worker_answers?(host, old)
      pid = Net::HTTP.start(address(host), PORT, open_timeout: 1, read_timeout: 5) { |http| http.get("/").body.split.last.to_i }
      !old.include?(pid)
    rescue SystemCallError, IOError, Net::OpenTimeout, Net::ReadTimeout
      false
    end
  end
end

require_relative "fleet_drill"
