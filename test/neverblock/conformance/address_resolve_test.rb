# frozen_string_literal: true

require_relative "conformance_helper"

# Name resolution in scheduled fibers (Scheduler#address_resolve): the
# system resolver, off the loop, with the same answers as blocking code.
class ConformanceAddressResolveTest < ConformanceTest
  def test_getaddrinfo_of_localhost_gives_loopback_addresses
    blocking = Addrinfo.getaddrinfo("localhost", 8080, nil, :STREAM).map(&:ip_address).sort
    results = nil
    on_scheduler_thread { schedule { results = Addrinfo.getaddrinfo("localhost", 8080, nil, :STREAM) } }
    refute_empty results
    assert results.all? { |ai| ai.ipv4_loopback? || ai.ipv6_loopback? }, results.inspect
    assert_equal [8080], results.map(&:ip_port).uniq
    assert_equal [Socket::SOCK_STREAM], results.map(&:socktype).uniq
    assert_equal blocking, results.map(&:ip_address).sort
  end

  def test_getaddrinfo_of_localhost_for_one_address_family
    results = nil
    on_scheduler_thread { schedule { results = Addrinfo.getaddrinfo("localhost", 80, :AF_INET, :STREAM) } }
    assert_equal ["127.0.0.1"], results.map(&:ip_address).uniq
    assert_equal [Socket::AF_INET], results.map(&:afamily).uniq
  end

  def test_tcp_socket_connects_to_localhost_by_name
    server = TCPServer.new("127.0.0.1", 0)
    port = server.local_address.ip_port
    greeting = nil
    on_scheduler_thread do
      schedule do
        connection = server.accept
        connection.write("hi from the server")
        connection.close
      end
      schedule do
        socket = TCPSocket.new("localhost", port)
        greeting = socket.read
        socket.close
      end
    end
    assert_equal "hi from the server", greeting
  ensure
    server&.close
  end

  # Ruby's *_non_blocking tests: numeric hosts, "<any>" and nil.
  def test_numeric_and_special_hosts
    results = {}
    on_scheduler_thread do
      schedule do
        results[:ipv4] = Addrinfo.getaddrinfo("127.0.0.1", 80, :AF_INET, :STREAM).map(&:ip_address)
        results[:ipv6] = Addrinfo.getaddrinfo("::1", 80, :AF_INET6, :STREAM).map(&:ip_address)
        results[:any] = Addrinfo.getaddrinfo("<any>", 80, :AF_INET, :STREAM).map(&:ip_address)
        results[:none] = Addrinfo.getaddrinfo(nil, 80, :AF_INET, :STREAM).map(&:ip_address)
      end
    end
    assert_equal({ ipv4: ["127.0.0.1"], ipv6: ["::1"], any: ["0.0.0.0"], none: ["127.0.0.1"] }, results)
  end

  # Ruby's test_addrinfo_ip/tcp/udp, test_ip_socket_getaddress and
  # test_socket_getnameinfo, with a name every system resolves.
  def test_other_resolving_calls_answer_like_blocking_code
    results = {}
    on_scheduler_thread do
      schedule do
        results[:tcp] = Addrinfo.tcp("localhost", 80).then { |ai| [ai.ip_port, ai.socktype] }
        results[:udp] = Addrinfo.udp("localhost", 53).then { |ai| [ai.ip_port, ai.socktype] }
        results[:ip] = Addrinfo.ip("localhost").ip_address
        results[:getaddress] = IPSocket.getaddress("localhost")
        results[:getnameinfo] = Socket.getnameinfo(["AF_INET", 80, "localhost"], Socket::NI_NUMERICHOST | Socket::NI_NUMERICSERV)
      end
    end
    assert_equal [80, Socket::SOCK_STREAM], results[:tcp]
    assert_equal [53, Socket::SOCK_DGRAM], results[:udp]
    assert_includes %w[127.0.0.1 ::1], results[:ip]
    assert_includes %w[127.0.0.1 ::1], results[:getaddress]
    assert_equal %w[127.0.0.1 80], results[:getnameinfo]
  end

  def test_an_unknown_host_raises_socket_error
    error = nil
    on_scheduler_thread(limit: 15) do
      schedule do
        Addrinfo.getaddrinfo("no-such-host.invalid", nil)
      rescue SocketError => e
        error = e
      end
    end
    assert_kind_of SocketError, error
  end

  def test_many_fibers_resolve_at_once
    results = []
    on_scheduler_thread do
      20.times { schedule { results << Addrinfo.getaddrinfo("localhost", 80, :AF_INET, :STREAM).first.ip_address } }
    end
    assert_equal ["127.0.0.1"] * 20, results
  end
end
