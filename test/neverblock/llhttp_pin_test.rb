# frozen_string_literal: true

require "test_helper"
require "open3"

# The llhttp gem keeps each parser's delegate as a bare C reference that GC
# compaction does not update. Process.warmup compacts (neverblock serve calls
# it once the app is loaded), and so do GC.compact and GC.auto_compact: a
# delegate moved under a live parser, or the LLHttp::Error class moved before
# llhttp raised it, segfaulted the server and the reverse proxy on Ruby 3.3.
# Each check runs in a child process, which compacts the heap moving every
# object that can move and then parses again through the parsers made before.
class LLHttpPinTest < PlainTest
  LIB = File.expand_path("../../lib", __dir__)

  # Moves every movable object (Ruby 3.1 names the heap-growing option differently).
  COMPACT = <<~RUBY
    options = RUBY_VERSION >= "3.2" ? { expand_heap: true } : { double_heap: true }
    GC.verify_compaction_references(toward: :empty, **options)
  RUBY

  def setup
    skip "this Ruby cannot compact its heap" unless GC.respond_to?(:verify_compaction_references)
  end

  # Through llhttp's callbacks, and through the C fast path (whose env keys
  # and per-connection values are its own GC roots) beside it.
  def test_the_servers_request_parser_survives_a_compaction
    assert_child_prints "800 requests", <<~RUBY
      require "neverblock/server"
      limits = NeverBlock::Server::Limits.build({})
      parsers = [false, NeverBlock::Server::Parser.head_parser?].flat_map do |fast_path|
        Array.new(200) do
          parser = NeverBlock::Server::Parser.new(limits, { "rack.url_scheme" => +"http" }, "localhost", "80", fast_path)
          parser << "GET /before HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"
          parser
        end
      end
      #{COMPACT}
      parsers.each { |parser| parser << "GET /after HTTP/1.1\\r\\nHost: x\\r\\nX-A: b\\r\\n\\r\\n" }
      seen = parsers.flat_map do |parser|
        parser.requests.map { |request| request.env.values_at("PATH_INFO", "HTTP_HOST", "rack.url_scheme").join(" ") }
      end
      expected = { "/before x http" => 400, "/after x http" => 400 }
      raise seen.tally.inspect unless seen.tally == expected
      puts "\#{seen.size} requests"
    RUBY
  end

  def test_the_reverse_proxys_upstream_connection_survives_a_compaction
    assert_child_prints "200 responses", <<~RUBY
      require "socket"
      require "neverblock/reverse_proxy"
      pairs = Array.new(200) do
        ours, theirs = UNIXSocket.pair
        [NeverBlock::ReverseProxy::UpstreamConnection.new(ours, 5), theirs]
      end
      #{COMPACT}
      bodies = pairs.map do |connection, upstream|
        upstream.write("HTTP/1.1 200 OK\\r\\nContent-Length: 5\\r\\nX-A: b\\r\\n\\r\\nhello")
        status, headers = connection.exchange("GET / HTTP/1.1\\r\\nHost: x\\r\\n", nil)
        raise [status, headers].inspect unless status == 200 && headers["x-a"] == "b"
        body = +""
        connection.each_body_chunk { |chunk| body << chunk }
        body
      end
      raise bodies.tally.inspect unless bodies.tally == { "hello" => 200 }
      puts "\#{bodies.size} responses"
    RUBY
  end

  # A request llhttp refuses raises LLHttp::Error from C, through a class
  # reference taken when the gem loaded.
  def test_a_request_llhttp_refuses_after_a_compaction_is_a_400
    assert_child_prints "400 HPE_INVALID_CONTENT_LENGTH", "require 'neverblock/server'\n#{COMPACT}" + <<~'RUBY'
      parser = NeverBlock::Server::Parser.new(NeverBlock::Server::Limits.build({}), {}, "localhost", "80", false)
      begin
        parser << "GET / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n"
      rescue NeverBlock::Server::HTTPError => e
        puts "#{e.status} #{e.message[/HPE_\w+/]}"
      end
    RUBY
  end

  def test_a_response_llhttp_refuses_after_a_compaction_is_a_bad_response
    assert_child_prints "BadResponse HPE_INVALID_CONTENT_LENGTH",
                        "require 'socket'\nrequire 'neverblock/reverse_proxy'\n#{COMPACT}" + <<~'RUBY'
                          ours, theirs = UNIXSocket.pair
                          connection = NeverBlock::ReverseProxy::UpstreamConnection.new(ours, 5)
                          theirs.write("HTTP/1.1 200 OK\r\nContent-Length: abc\r\n\r\n")
                          begin
                            connection.exchange("GET / HTTP/1.1\r\nHost: x\r\n", nil)
                          rescue NeverBlock::ReverseProxy::UpstreamConnection::BadResponse => e
                            puts "BadResponse #{e.message[/HPE_\w+/]}"
                          end
                        RUBY
  end

  private

  def assert_child_prints(expected, script)
    out, err, status = Open3.capture3(RbConfig.ruby, "-I", LIB, "-e", script)
    assert status.success?, "the child failed (#{status.inspect}): #{err.lines.first(12).join}"
    assert_equal expected, out.strip
  end
end
