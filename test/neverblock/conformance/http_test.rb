# frozen_string_literal: true

require_relative "conformance_helper"
require "net/http"
require "openssl"

# Net::HTTP in scheduled fibers (Ruby's test_http.rb), against a small HTTP
# server running in fibers of the same loop, in plain text and over TLS.
class ConformanceHTTPTest < ConformanceTest
  # Serves `count` connections, each in a fiber of its own: reads a request,
  # waits `delay` seconds, answers "hello <path>".
  def serve(server, count, delay)
    schedule do
      count.times do
        connection = server.accept
        schedule do
          request = connection.gets("\r\n\r\n")
          sleep delay
          body = "hello #{request[%r{\AGET (\S+)}, 1]}"
          connection.write("HTTP/1.1 200 OK\r\nContent-Length: #{body.bytesize}\r\nConnection: close\r\n\r\n#{body}")
        ensure
          connection.close
        end
      end
    end
  end

  def test_concurrent_gets_against_a_local_server
    tcp = TCPServer.new("127.0.0.1", 0)
    port = tcp.local_address.ip_port
    bodies = []
    duration = elapsed do
      on_scheduler_thread do
        serve(tcp, 5, 0.2)
        5.times { |index| schedule { bodies << Net::HTTP.get(URI("http://127.0.0.1:#{port}/#{index}")) } }
      end
    end
    assert_equal 5.times.map { |index| "hello /#{index}" }, bodies.sort
    assert_operator duration, :<, 0.9, "five 0.2 s requests served one after the other?"
  ensure
    tcp&.close
  end

  # excon waits with IO.select, which reaches a scheduler (io_select) only
  # from Ruby 3.2; on 3.1 each request would hold the loop, unless the app
  # requires neverblock/io_select (a no-op on 3.2+), as here.
  def test_excon_requests_run_concurrently_through_io_select
    require "neverblock/io_select"
    require "excon"
    port = slow_http_server
    bodies = []
    duration = elapsed do
      on_scheduler_thread do
        10.times { |index| schedule { bodies << Excon.get("http://127.0.0.1:#{port}/#{index}", read_timeout: 10).body } }
      end
    end
    assert_equal 10.times.map { |index| "/#{index}" }.sort, bodies.sort
    assert_operator duration, :<, 2.5, "ten 0.5 s excon requests took #{duration.round(2)} s: one after the other?"
  end

  def test_gets_over_tls_with_a_self_signed_certificate
    tcp = TCPServer.new("127.0.0.1", 0)
    port = tcp.local_address.ip_port
    server = OpenSSL::SSL::SSLServer.new(tcp, TestCertificates.server_context("localhost"))
    bodies = []
    on_scheduler_thread do
      serve(server, 3, 0.01)
      3.times do |index|
        schedule do
          http = Net::HTTP.new("localhost", port)
          http.ipaddr = "127.0.0.1"
          http.use_ssl = true
          http.verify_mode = OpenSSL::SSL::VERIFY_NONE
          bodies << http.get("/secure/#{index}").body
        end
      end
    end
    assert_equal 3.times.map { |index| "hello /secure/#{index}" }, bodies.sort
  ensure
    tcp&.close
  end
end
