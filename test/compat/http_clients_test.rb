# frozen_string_literal: true

require_relative "compat_helper"
require "net/http"
require "open-uri"
require "json"

# HTTP clients against a local server that answers each request after
# 0.5 s: ten requests at once in one loop take about 0.5 s.
class CompatHTTPClientsTest < CompatTest
  def setup
    super
    @url = slow_http_server
  end

  def test_net_http
    bodies = assert_concurrent_calls("Net::HTTP") { |index| Net::HTTP.get(URI("#{@url}/#{index}")) }
    assert_equal paths, bodies
  end

  def test_open_uri
    bodies = assert_concurrent_calls("open-uri") { |index| URI.parse("#{@url}/#{index}").open(&:read) }
    assert_equal paths, bodies
  end

  def test_faraday_with_its_net_http_adapter
    require "faraday"
    connection = Faraday.new(@url) { |builder| builder.adapter :net_http }
    bodies = assert_concurrent_calls("faraday (net_http adapter)", gem: "faraday") do |index|
      connection.get("/#{index}").body
    end
    assert_equal paths, bodies
  end

  # The adapter keeps one HTTPX session per Faraday connection: fibers
  # sharing a connection take turns (threads do not; the loop stays free
  # meanwhile), on every Ruby. A connection per fiber runs them at once.
  # (While NeverBlock offered Ruby 3.4 the blocking_operation_wait hook, the
  # first ten calls on a new connection there overlapped, because the
  # plugins HTTPX requires on first use were read through the hook, and the
  # row read "concurrent"; every later batch took turns, 5 s.)
  def test_faraday_with_the_httpx_adapter
    require "faraday"
    require "httpx/adapters/faraday"
    shared = Faraday.new(@url) { |builder| builder.adapter :httpx }
    bodies = assert_concurrent_calls("faraday (httpx adapter)", gem: "faraday", fix: :connection_per_fiber,
                                     unfixed: ->(index) { shared.get("/#{index}").body }) do |index|
      Faraday.new(@url) { |builder| builder.adapter :httpx }.get("/#{index}").body
    end
    assert_equal paths, bodies
  end

  def test_httpx
    require "httpx"
    bodies = assert_concurrent_calls("httpx", gem: "httpx") { |index| HTTPX.get("#{@url}/#{index}").to_s }
    assert_equal paths, bodies
  end

  def test_http_rb
    require "http"
    bodies = assert_concurrent_calls("http.rb", gem: "http") { |index| HTTP.get("#{@url}/#{index}").to_s }
    assert_equal paths, bodies
  end

  def test_rest_client
    require "rest-client"
    bodies = assert_concurrent_calls("rest-client", gem: "rest-client") { |index| RestClient.get("#{@url}/#{index}").body }
    assert_equal paths, bodies
  end

  def test_httparty
    require "httparty"
    bodies = assert_concurrent_calls("httparty", gem: "httparty") { |index| HTTParty.get("#{@url}/#{index}").body }
    assert_equal paths, bodies
  end

  # One Net::HTTP::Persistent shared by every fiber, as an app holds it: its
  # connection pool hands each fiber a connection of its own.
  def test_net_http_persistent
    require "net/http/persistent"
    http = Net::HTTP::Persistent.new(name: "compat", pool_size: CALLS)
    bodies = assert_concurrent_calls("net-http-persistent", gem: "net-http-persistent") do |index|
      http.request(URI("#{@url}/#{index}")).body
    end
    assert_equal paths, bodies
  ensure
    http&.shutdown
  end

  # excon waits with IO.select: the io_select hook exists from Ruby 3.2.
  def test_excon
    require "excon"
    bodies = assert_concurrent_calls("excon", gem: "excon", fix: (:io_select unless io_select_hook?)) do |index|
      Excon.get("#{@url}/#{index}", read_timeout: 10).body
    end
    assert_equal paths, bodies
  end

  # libcurl waits inside C, where no hook sees it (test/neverblock/conformance/libcurl_test.rb).
  def test_typhoeus
    require "typhoeus"
    bodies = assert_concurrent_calls("Typhoeus (libcurl)", gem: "typhoeus", fix: :defer) do |index|
      Typhoeus.get("#{@url}/#{index}", timeout: 10).body
    end
    assert_equal paths, bodies
  end

  # An S3-style endpoint: GetObject by path-style URL, the body is the path.
  def test_aws_sdk_s3
    require "aws-sdk-s3"
    s3 = Aws::S3::Client.new(endpoint: @url, region: "us-east-1", force_path_style: true,
                             credentials: Aws::Credentials.new("key", "secret"), retry_limit: 0)
    bodies = assert_concurrent_calls("aws-sdk-s3", gem: "aws-sdk-s3") do |index|
      s3.get_object(bucket: "compat", key: "object-#{index}").body.read
    end
    assert_equal CALLS.times.map { |index| "/compat/object-#{index}" }, bodies
  end

  # Stripe's API served locally: GET /v1/customers/ID answers a customer.
  def test_stripe
    require "stripe"
    url = slow_http_server(content_type: "application/json") do |path|
      JSON.generate(id: URI(path).path.split("/").last, object: "customer")
    end
    stripe = Stripe::StripeClient.new("sk_test_compat", api_base: url)
    ids = assert_concurrent_calls("stripe", gem: "stripe") { |index| stripe.v1.customers.retrieve("cus_#{index}").id }
    assert_equal CALLS.times.map { |index| "cus_#{index}" }, ids
  end

  # HTTPS: Net::HTTP over TLS (the handshake and the reads wait on the socket).
  def test_net_http_over_tls
    url = URI(slow_http_server(tls: true))
    bodies = assert_concurrent_calls("Net::HTTP over TLS") do |index|
      Net::HTTP.start(url.host, url.port, use_ssl: true, verify_mode: OpenSSL::SSL::VERIFY_NONE) do |http|
        http.get("/#{index}").body
      end
    end
    assert_equal paths, bodies
  end

  private

  def paths
    CALLS.times.map { |index| "/#{index}" }
  end

  def io_select_hook?
    Gem::Version.new(RUBY_VERSION) >= Gem::Version.new("3.2")
  end
end
