# frozen_string_literal: true

require "socket"

module NeverBlock
  class Server
    # A connected socket's addresses as text (REMOTE_ADDR, the default
    # SERVER_NAME), read from the kernel's `sockaddr` without getnameinfo(3).
    #
    # Ruby 3.3 and later, as most builds have it, run every getnameinfo,
    # numeric or not, on a thread of its own so that it can be interrupted:
    # `Addrinfo#ip_address`,
    # `Socket.unpack_sockaddr_in` and `#peeraddr` each start and join a
    # native thread, some 50 µs of CPU, where formatting four bytes takes
    # well under one. A server that read both addresses that way paid about
    # 100 µs for every connection it accepted: more than a whole hello-world
    # request, on every request from a proxy that opens a connection per
    # request (nginx's default to its upstreams).
    #
    # The address sits at the same offset in a `sockaddr_in` (16 bytes) and a
    # `sockaddr_in6` (28 bytes) on Linux and on the BSDs, whose family field
    # differs. A link-local peer's scope zone, which getnameinfo appended
    # (`fe80::1%eth0`), is left out.
    module PeerAddress
      # The first two bytes of each kind of sockaddr: the family (Linux),
      # or the length and the family (the BSDs).
      INET = Socket.sockaddr_in(0, "0.0.0.0").byteslice(0, 2)
      INET6 = Socket.sockaddr_in(0, "::").byteslice(0, 2)

      module_function

      # @param socket [BasicSocket] a connected TCP socket (or what wraps
      #   one and answers #to_io).
      # @return [String] its peer's IP address, e.g. "127.0.0.1", "::1".
      # @raise [SystemCallError] when the socket is not connected.
      def remote(socket)
        ip(socket.to_io.getpeername)
      end

      # @param socket [BasicSocket]
      # @return [String] the socket's own IP address.
      # @raise [SystemCallError]
      def local(socket)
        ip(socket.to_io.getsockname)
      end

      # @param sockaddr [String] a packed sockaddr_in or sockaddr_in6.
      # @return [String] its address as inet_ntop(3) writes it.
      # @raise [ArgumentError] for another kind of address.
      def ip(sockaddr)
        if sockaddr.bytesize == 16 && sockaddr.start_with?(INET) then cached_ipv4(sockaddr)
        elsif sockaddr.bytesize == 28 && sockaddr.start_with?(INET6) then ipv6(sockaddr)
        else raise ArgumentError, "not an IPv4 or IPv6 socket address (#{sockaddr.bytesize} bytes)"
        end
      end

      # IPv4 addresses formatted so far, by their 32 bits: a server's peers
      # are mostly the same few (a proxy, a load balancer; its own address
      # for the default SERVER_NAME), and a text made before costs no String
      # per connection. Emptied when it holds IPV4_TEXTS (a server facing
      # the whole internet then formats as before).
      @ipv4_texts = {}
      IPV4_TEXTS = 256

      # @return [String] the IPv4 address of a `sockaddr_in`, frozen.
      #   (Called on the module, as every function here: the module keeps
      #   the texts. Under the GVL a Hash is safe from several threads.)
      def cached_ipv4(sockaddr)
        address = sockaddr.unpack1("N", offset: 4)
        texts = @ipv4_texts
        text = texts[address]
        return text if text

        texts.clear if texts.size >= IPV4_TEXTS
        texts[address] = -ipv4(sockaddr, 4)
      end

      def ipv4(bytes, at)
        "#{bytes.getbyte(at)}.#{bytes.getbyte(at + 1)}.#{bytes.getbyte(at + 2)}.#{bytes.getbyte(at + 3)}"
      end

      # RFC 5952's form, as glibc's inet_ntop writes it: the longest run of
      # two or more zero groups (the first of equal ones) as "::", and the
      # last 32 bits as an IPv4 address after six zero groups, or five and
      # ffff (an IPv4-mapped address).
      def ipv6(sockaddr)
        groups = sockaddr.unpack("@8n8")
        run_at, run = longest_zero_run(groups)
        text = +""
        index = 0
        while index < 8
          if run_at && index == run_at
            text << "::"
            index += run
            next
          end
          text << ":" unless index.zero? || text.end_with?(":")
          if index == 6 && run_at&.zero? && (run == 6 || (run == 5 && groups[5] == 0xffff))
            text << ipv4(sockaddr, 20)
            break
          end
          text << groups[index].to_s(16)
          index += 1
        end
        text
      end

      # @return [Array(Integer, Integer), nil] where the longest run of two
      #   or more zero groups starts, and its length.
      def longest_zero_run(groups)
        best_at = best = nil
        at = nil
        groups.each_with_index do |group, index|
          if group.zero?
            at ||= index
            length = index - at + 1
            best_at, best = at, length if length >= 2 && (best.nil? || length > best) # rubocop:disable Style/ParallelAssignment
          else
            at = nil
          end
        end
        best_at && [best_at, best]
      end
    end
  end
end
