# frozen_string_literal: true

require "test_helper"
require "open3"

# The llhttp gem keeps each parser's delegate as a bare C reference that GC
# compaction does not update. Process.warmup compacts (neverblock serve calls
# it once the app is loaded), and so do GC.compact and GC.auto_compact: a
# delegate moved under a live parser, or the LLHttp::Error class moved before
# llhttp raised it, segfaulted the server and the reverse proxy on Ruby 3.3.
# Each check runs in a child process, which compacts the heap (moving what
# it can: on Ruby 3.1 an instance variable's value is pinned anyway, so there
# only the error class's checks fail without the pins) and then parses again
# through the parsers made before.
class LLHttpPinTest < PlainTest
  LIB = File.expand_path("../../lib", __dir__)

  # Moves every movable object (Ruby 3.1 names the heap-growing option
  # differently), and `address` tells where an object is.
  COMPACT = <<~RUBY
    options = RUBY_VERSION >= "3.2" ? { expand_heap: true } : { double_heap: true }
    GC.verify_compaction_references(toward: :empty, **options)
  RUBY
  ADDRESS = "address = ->(object) { Kernel.instance_method(:to_s).bind_call(object)[/0x\\h+/] }\n"

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

  # Any parser, as the http gem makes them: its delegate stays put.
  def test_a_parser_anyone_makes_keeps_its_delegate_where_it_was
    assert_child_prints "200 unmoved, 200 parsed", "require 'neverblock'\n#{ADDRESS}" + <<~'RUBY' + COMPACT + <<~'RUBY2'
      class Handler < LLHttp::Delegate
        attr_reader :status
        def on_status(text) = (@status = text)
      end
      parsers = Array.new(200) { LLHttp::Parser.new(Handler.new, type: :response) }
      before = parsers.map { |parser| address.call(parser.instance_variable_get(:@delegate)) }
    RUBY
      after = parsers.map { |parser| address.call(parser.instance_variable_get(:@delegate)) }
      parsers.each { |parser| parser << "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n" }
      parsed = parsers.count { |parser| parser.instance_variable_get(:@delegate).status == "Not Found" }
      puts "#{before.zip(after).count { |was, is| was == is }} unmoved, #{parsed} parsed"
    RUBY2
  end

  # llhttp loaded and a compaction before neverblock could pin its error
  # class: told on stderr (pinning the class then cannot undo it).
  def test_llhttp_loaded_and_compacted_before_neverblock_is_warned_of
    _, err, status = Open3.capture3(RbConfig.ruby, "-I", LIB, "-e", "require 'llhttp'\n#{COMPACT}require 'neverblock'")
    assert status.success?, err
    assert_match(/llhttp was loaded and the heap compacted before `neverblock` was required/, err)

    _, err, status = Open3.capture3(RbConfig.ruby, "-I", LIB, "-e", "require 'neverblock'\n#{COMPACT}require 'llhttp'")
    assert status.success?, err
    refute_match(/llhttp/, err)
  end

  # What neverblock serve's warmup runs its compaction in.
  def test_across_compaction_returns_the_blocks_value_with_the_error_class_where_it_was
    assert_child_prints "done, LLHttp::Error in place", "require 'neverblock'\n" + <<~'RUBY'
      value = NeverBlock::LLHttpPin.across_compaction do
        options = RUBY_VERSION >= "3.2" ? { expand_heap: true } : { double_heap: true }
        GC.verify_compaction_references(toward: :empty, **options)
        "done"
      end
      puts "#{value}, LLHttp::Error in place"
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
