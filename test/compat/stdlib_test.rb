# frozen_string_literal: true

require_relative "compat_helper"
require "open3"
require "resolv"
require "net/smtp"

# Ruby's standard library beyond HTTP: DNS, child processes, pipes, raw
# sockets and SMTP, each call waiting 0.5 s on a server or a child.
class CompatStdlibTest < CompatTest
  # Resolv (pure Ruby DNS over UDP) against a local DNS server. resolv 0.6+
  # (Ruby 3.4) asks for the AAAA record before the A where the machine has a
  # global IPv6 address: two exchanges a call, which the page notes.
  def test_resolv
    port = slow_dns_server
    note = lambda do
      next unless dns_questions.include?("AAAA")

      "two exchanges a call, about 1 s: this resolv asks for the AAAA record, then the A (resolv 0.6+, " \
        "where the machine has a global IPv6 address)"
    end
    addresses = assert_concurrent_calls("Resolv::DNS", note: note) do |index|
      Resolv::DNS.open(nameserver_port: [["127.0.0.1", port]]) do |dns|
        dns.timeouts = 10
        dns.getaddress("host-#{index}.compat.test").to_s
      end
    end
    assert_equal ["10.0.0.1"] * CALLS, addresses
  end

  # The child-process rows: each child sleeps DELAY, then waits for all the
  # others to have started (CompatMatrix#child_argv).
  def test_open3
    outputs = assert_concurrent_calls("Open3.capture2", children: true) do |index|
      output, status = Open3.capture2(*child_argv(index, output: index.to_s))
      assert_predicate status, :success?
      output
    end
    assert_equal lines, outputs
  end

  def test_spawn_and_wait
    statuses = assert_concurrent_calls("Process.spawn + Process.wait", children: true) do |index|
      pid = Process.spawn(*child_argv(index, exit_status: index))
      Process.wait2(pid).last.exitstatus
    end
    assert_equal CALLS.times.to_a, statuses
  end

  def test_pipes_from_a_child
    outputs = assert_concurrent_calls("IO.popen (pipes)", children: true) do |index|
      IO.popen(child_argv(index, output: index.to_s), &:read)
    end
    assert_equal lines, outputs
  end

  def test_tcp_socket
    port = URI(slow_http_server).port
    heads = assert_concurrent_calls("TCPSocket") do |index|
      TCPSocket.open("127.0.0.1", port) do |socket|
        socket.write("GET /#{index} HTTP/1.1\r\nHost: compat\r\n\r\n")
        socket.read[/\r\n\r\n(.*)\z/m, 1]
      end
    end
    assert_equal CALLS.times.map { |index| "/#{index}" }, heads
  end

  def test_tls_socket
    port = URI(slow_http_server(tls: true)).port
    context = OpenSSL::SSL::SSLContext.new
    context.verify_mode = OpenSSL::SSL::VERIFY_NONE
    bodies = assert_concurrent_calls("OpenSSL::SSL::SSLSocket") do |index|
      tls = OpenSSL::SSL::SSLSocket.new(TCPSocket.new("127.0.0.1", port), context)
      tls.sync_close = true
      tls.connect
      tls.write("GET /#{index} HTTP/1.1\r\nHost: compat\r\n\r\n")
      tls.read[/\r\n\r\n(.*)\z/m, 1]
    ensure
      tls&.close
    end
    assert_equal CALLS.times.map { |index| "/#{index}" }, bodies
  end

  def test_net_smtp
    port = slow_smtp_server
    replies = assert_concurrent_calls("Net::SMTP", gem: "net-smtp") do |index|
      Net::SMTP.start("127.0.0.1", port, starttls: false) do |smtp|
        smtp.send_message("Subject: #{index}\r\n\r\nhello\r\n", "from@compat.test", "to@compat.test").string
      end
    end
    assert_equal ["250 accepted\n"] * CALLS, replies
  end

  private

  def lines
    CALLS.times.map { |index| "#{index}\n" }
  end
end
