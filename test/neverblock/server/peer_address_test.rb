# frozen_string_literal: true

require_relative "server_helper"

# REMOTE_ADDR and the default SERVER_NAME come from the kernel's sockaddr,
# formatted as inet_ntop(3) does, without getnameinfo(3): Ruby 3.3 and
# later run each getnameinfo on a thread of its own (some 50 µs), twice for
# every connection accepted.
class ServerPeerAddressTest < PlainTest
  include ServerHelper

  PeerAddress = NeverBlock::Server::PeerAddress

  ADDRESSES = %w[127.0.0.1 10.1.2.3 0.0.0.0 255.255.255.255 ::1 :: 1:: ::ffff:127.0.0.1 ::7f00:1
                 2001:db8::1:0:0:1 2001:db8:0:0:1:0:0:1 fe80::1 1:2:3:4:5:6:7:8 1:0:0:2:0:0:0:3].freeze

  def test_an_address_reads_as_getnameinfo_writes_it
    ADDRESSES.each do |address|
      sockaddr = Socket.sockaddr_in(80, address)
      assert_equal Addrinfo.new(sockaddr).ip_address, PeerAddress.ip(sockaddr), address
    end
  end

  def test_ipv6_addresses_with_runs_of_zeros_read_as_getnameinfo_writes_them
    random = Random.new(42)
    2000.times do
      address = Array.new(8) { [0, 0, 0, 1, 0xffff, random.rand(65_536)].sample(random: random).to_s(16) }.join(":")
      sockaddr = Socket.sockaddr_in(80, address)
      assert_equal Addrinfo.new(sockaddr).ip_address, PeerAddress.ip(sockaddr), address
    end
  end

  # IPv4 texts are kept (a server's peers are mostly a few proxies): the
  # same frozen String for an address seen before, and the right text for
  # every address however many come (the kept ones are let go past
  # IPV4_TEXTS).
  def test_an_ipv4_address_seen_before_costs_no_string
    first = PeerAddress.ip(Socket.sockaddr_in(80, "10.9.8.7"))
    assert_predicate first, :frozen?
    assert_same first, PeerAddress.ip(Socket.sockaddr_in(443, "10.9.8.7"))
    (PeerAddress::IPV4_TEXTS * 2).times do |index|
      address = "10.#{index / 256}.#{index % 256}.#{index % 7}"
      assert_equal address, PeerAddress.ip(Socket.sockaddr_in(80, address))
    end
    assert_equal "10.9.8.7", PeerAddress.ip(Socket.sockaddr_in(80, "10.9.8.7"))
    assert_operator PeerAddress.instance_variable_get(:@ipv4_texts).size, :<=, PeerAddress::IPV4_TEXTS
  end

  def test_another_kind_of_address_is_refused
    error = assert_raises(ArgumentError) { PeerAddress.ip(Socket.sockaddr_un("/tmp/x")) }
    assert_match(/not an IPv4 or IPv6/, error.message)
    # A unix socket's address as the kernel gives it: the length of its
    # path, here the size of an IPv4 or an IPv6 one.
    [16 - 2, 28 - 2].each do |path_length|
      sockaddr = Socket.sockaddr_un("/#{'x' * (path_length - 1)}").byteslice(0, 2 + path_length)
      assert_raises(ArgumentError, sockaddr.bytesize.to_s) { PeerAddress.ip(sockaddr) }
    end
  end

  def test_reading_a_connections_addresses_costs_a_fraction_of_getnameinfo
    server = TCPServer.new("127.0.0.1", 0)
    client = TCPSocket.new("127.0.0.1", server.addr[1])
    accepted = server.accept
    assert_equal [client.local_address.ip_address, "127.0.0.1"], [PeerAddress.remote(accepted), PeerAddress.local(accepted)]
    # Interleaved rounds, each way's cheapest: the machine's load inflates both.
    ours = getnameinfo = Float::INFINITY
    5.times do
      ours = [ours, cpu_seconds { 200.times { PeerAddress.remote(accepted) && PeerAddress.local(accepted) } }].min
      getnameinfo = [getnameinfo, cpu_seconds { 200.times { accepted.remote_address.ip_address && accepted.local_address.ip_address } }].min
    end
    # Where Ruby runs each getnameinfo on a thread of its own (3.3 and later,
    # as built here: 50 µs and more a call), it is some 20 times dearer;
    # where it runs on the calling thread (3.1, Debian's 3.4 package) the
    # two cost about the same.
    skip "getnameinfo runs on the calling thread here (#{(getnameinfo / 400 * 1e6).round(1)} µs a call)" if getnameinfo / 400 < 20e-6

    assert_operator ours * 4, :<, getnameinfo, "CPU seconds for 200 connections' two addresses: #{ours} against #{getnameinfo}"
  ensure
    [client, accepted, server].each { |io| io&.close }
  end

  def test_the_server_gives_the_app_both_addresses_over_ipv6
    app = ->(env) { [200, { "content-type" => "text/plain" }, ["#{env['REMOTE_ADDR']} #{env['SERVER_NAME']}"]] }
    server = NeverBlock::Server.new(app, bind: ["tcp://[::1]:0"], workers: 0)
    port = Integer(server.bound_addresses.first[/\d+\z/])
    thread = Thread.new { server.run }
    socket = Socket.tcp("::1", port)
    socket.write("GET / HTTP/1.0\r\n\r\n")
    assert_equal "::1 [::1]", socket.read.split("\r\n\r\n", 2).last
  rescue Errno::EADDRNOTAVAIL, Errno::EAFNOSUPPORT => e
    skip "no IPv6 loopback here: #{e.message}"
  ensure
    socket&.close
    server&.stop
    thread&.join(10)
  end

  private

  def cpu_seconds
    started = Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID)
    yield
    Process.clock_gettime(Process::CLOCK_PROCESS_CPUTIME_ID) - started
  end
end
