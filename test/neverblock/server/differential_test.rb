# frozen_string_literal: true

require "tmpdir"
require_relative "server_helper"
require_relative "smuggling_corpus"
require_relative "../../support/front_proxy"
require_relative "../../support/smuggling_check"

# Request smuggling, tested as HTTP Garden and PortSwigger's research test
# it: every ambiguous request of SmugglingCorpus (CL.TE, TE.CL, obfuscated
# Transfer-Encodings, chunk framing, bare CR and LF, duplicate and malformed
# headers...) goes to a real NeverBlock::Server, on a new connection each,
# directly and through nginx and HAProxy as deployed in front of it. The
# server must never serve a request nobody sent: directly, the
# `/smuggled-<case>` request hidden in each case; behind a proxy, anything
# the proxy did not forward. It may refuse (400) what a proxy forwarded.
# The valid control cases must be served whole. Directly, the client
# half-closes once it has sent a case and reads until the server closes.
class ServerDifferentialTest < PlainTest
  include ServerHelper

  def setup
    super
    @served = Queue.new
    served = @served
    app = lambda do |env|
      body = env["rack.input"].read
      served << SmugglingCheck::Served.new(env["REQUEST_METHOD"], SmugglingCheck.target(env), body.bytesize)
      [200, { "content-type" => "text/plain", "content-length" => "2" }, ["ok"]]
    end
    # A proxy's kept-alive connections outlive the run: none closes under a request sent on it.
    start_server(app, idle_timeout: 120)
  end

  def teardown
    @proxy&.stop
    super
  ensure
    FileUtils.rm_rf(@dir) if @dir
  end

  def test_neverblock_alone_serves_no_smuggled_request_and_every_control_case_whole
    assert_no_failures("directly") { |kase| SmugglingCheck.exchange(@port, kase.bytes, half_close: true) }
  end

  def test_behind_nginx_it_serves_only_what_nginx_forwarded
    assert_behind(FrontProxy::Nginx, "nginx-light")
  end

  def test_behind_haproxy_it_serves_only_what_haproxy_forwarded
    assert_behind(FrontProxy::HAProxy, "haproxy")
  end

  private

  # Starts `proxy` in front of the server and checks every case through it.
  def assert_behind(proxy, package)
    skip "#{proxy::BINARY} is not installed (bin/setup installs Debian's #{package})" unless proxy.binary

    @dir = Dir.mktmpdir("neverblock-differential-")
    @proxy = proxy.start(upstream_port: @port, dir: @dir)
    assert_no_failures("behind #{proxy::BINARY}", @proxy) do |kase|
      SmugglingCheck.exchange(@proxy.port, kase.bytes, half_close: false)
    end
  end

  # Sends every case (the block sends one and returns what it read), then
  # judges what the server served of each once it has closed every
  # connection (behind `proxy`, once the proxy stopped).
  def assert_no_failures(path, proxy = nil)
    responses = {}
    capture_log do # the server's refusal lines
      SmugglingCorpus::CASES.each { |kase| responses[kase.name] = yield(kase) }
    ensure
      proxy&.stop
      eventually { @server.stats[:connections].zero? }
    end
    served = Array.new(@served.size) { @served.pop }
    verdicts = SmugglingCheck.judge_all(responses, served: served, forwarded: proxy&.forwarded)
    failures = verdicts.filter_map { |name, verdict| "#{name}: #{verdict.failure}" if verdict.failure }
    assert failures.empty?, "#{failures.size} cases failed #{path}:\n#{failures.join("\n")}" \
                            "#{"\n#{proxy.class::BINARY}'s log:\n#{proxy.diagnostics}" if proxy}"
    assert verdicts.values.any? { |verdict| verdict.label == "ok" }, "nothing was served #{path}: #{verdicts.transform_values(&:label)}"
  end
end

# The same, every head through llhttp (as without the C extension).
class ServerDifferentialLlhttpHeadsTest < ServerDifferentialTest
  include LlhttpHeads
end
