# frozen_string_literal: true

require_relative "../../test_helper"
require "minitest/mock"
require "open3"
require "socket"
require "tmpdir"
require "rack/headers"
require "neverblock/server"

# Response#write's head, written two ways: the app's headers walked in Ruby,
# and in C (HTTPHead.response_headers, ext/neverblock/http_head/response_head.c),
# which writes what it can write alike and declines the rest to the Ruby walk.
# Every response here must come out byte for byte the same both ways, with the
# same keep-alive answer (or the same error).
class ResponseHeadTest < PlainTest
  Response = NeverBlock::Server::Response
  Request = Struct.new(:head, :http10)
  GET = Request.new(false, false)
  HEAD = Request.new(true, false)
  HTTP10 = Request.new(false, true)

  # A Hash whose `each` is its own: walked in Ruby, whatever it yields.
  class UpcasedHeaders < Hash
    def each
      super { |key, value| yield key.upcase, value }
    end
  end

  # Strings and Arrays that answer the Ruby walk's calls their own way.
  class LoudString < String
    def to_s = upcase
  end

  class KeptName < String
    def start_with?(*) = true
  end

  class ReversedArray < Array
    def each(&) = reverse.each(&)
  end

  # A plain Hash, String or Array with a method of its own.
  def self.with_singleton(object, name, &body)
    object.define_singleton_method(name, &body)
    object
  end

  RESPONSES = {
    "Rack 3's lowercase names" => [200, { "content-type" => "text/plain", "content-length" => "5" }, ["hello"]],
    "no headers" => [200, {}, ["hello"]],
    "Rack 2's names, in any case" => [200, { "Content-Type" => "text/plain", "CONTENT-LENGTH" => "5" }, ["hello"]],
    "an app's date" => [200, { "Date" => "Thu, 01 Jan 2026 00:00:00 GMT", "content-length" => "2" }, ["ok"]],
    "connection: close" => [200, { "Connection" => "close", "content-length" => "2" }, ["ok"]],
    "close in a list, in capitals" => [200, { "connection" => "upgrade, CLOSE" }, ["ok"]],
    "connection: keep-alive" => [200, { "connection" => "Keep-Alive" }, ["ok"]],
    "connection as an Array" => [200, { "connection" => ["close"] }, ["ok"]],
    "the app's own chunked framing" => [200, { "Transfer-Encoding" => "chunked" }, ["2\r\nok\r\n0\r\n\r\n"]],
    "Array values (Rack 3)" => [200, { "set-cookie" => %w[a=1 b=2], "x-none" => [] }, ["ok"]],
    "a value with LF" => [200, { "x-lines" => "a\nb", "content-type" => "text/plain" }, ["ok"]],
    "a value with CRLF" => [200, { "set-cookie" => "a=1\r\nb=2" }, ["ok"]],
    "a line break in an Array's String" => [200, { "set-cookie" => ["a=1", "b=2\nc=3"] }, ["ok"]],
    "a NUL" => [200, { "x-nul" => "a\0b" }, ["ok"]],
    "the server's own rack. headers" => [200, { "rack.protocol" => "x", "rack.hijack?" => "y", "x-ok" => "1" }, ["ok"]],
    "an Integer value" => [200, { "content-length" => 2, "x-count" => 3 }, ["ok"]],
    "a content-length that is no number" => [200, { "content-length" => "two" }, ["ok"]],
    "a content-length as an Array" => [200, { "content-length" => ["2"] }, ["ok"]],
    "a content-length the body overruns" => [200, { "content-length" => "2" }, ["okay"]],
    "UTF-8 in a value" => [200, { "x-name" => "café" }, ["ok"]],
    "bytes that are not UTF-8" => [200, { "content-type" => (+"text/plain; x=\xff").force_encoding(Encoding::BINARY) }, ["ok"]],
    "UTF-8 in a rack. name" => [200, { "rack.é" => "x" }, ["ok"]],
    "a Symbol name" => [200, { x: "1" }, ["ok"]],
    "Rack::Headers" => [200, Rack::Headers.new.merge!("content-type" => "text/plain", "x-id" => "7"), ["ok"]],
    "a Hash with an each of its own" => [200, UpcasedHeaders.new.merge!("x-id" => "7"), ["ok"]],
    "a streamed body" => [200, { "content-type" => "text/event-stream" }, Enumerator.new { |out| out << "a" << "b" }],
    "a streamed body with its length" => [200, { "content-length" => "2" }, Enumerator.new { |out| out << "a" << "b" }],
    "framing names with a capital I" => [200, { "TRANSFER-ENCODING" => "chunked", "CONNECTION" => "CLOSE" }, ["2\r\nok\r\n0\r\n\r\n"]],
    "a String subclass's to_s" => [200, { "x-loud" => LoudString.new("quiet"), "connection" => LoudString.new("close") }, ["ok"]],
    "a String with a to_s of its own" => [200, { "x-own" => with_singleton(+"plain", :to_s) { "own" } }, ["ok"]],
    "a name that answers start_with? its own way" => [200, { KeptName.new("x-kept") => "1", "x-ok" => "2" }, ["ok"]],
    "an Array subclass's each" => [200, { "set-cookie" => ReversedArray.new(%w[a=1 b=2]) }, ["ok"]],
    "headers with an each of their own" => [200, with_singleton({ "x-a" => "1" }, :each) { |&block| { "x-b" => "2" }.each(&block) }, ["ok"]],
    "headers as pairs (Rack 2)" => [200, [%w[x-a 1], %w[content-length 2]], ["ok"]],
    "names that are not tokens" => [200, { "x bad" => "1", "x\r\ninjected" => "2", "" => "3" }, ["ok"]],
    "204" => [204, { "x-ok" => "1" }, []],
    "304 with a length" => [304, { "content-length" => "5" }, []]
  }.freeze

  def setup
    skip "the C extension is not built" unless NeverBlock::HTTPHead.respond_to?(:response_headers)
  end

  def test_every_response_is_written_alike_in_c_and_in_ruby
    [GET, HEAD, HTTP10].product(RESPONSES.to_a, [true, false]).each do |request, (name, response), keep_alive|
      ruby = written(request, response, keep_alive, fast: false)
      c = written(request, response, keep_alive, fast: true)
      assert_equal ruby, c, "#{name} (#{request.to_h}, keep_alive: #{keep_alive})"
    end
  end

  # The C walk writes an ordinary response's headers (else the comparison
  # above would compare the Ruby walk with itself) and declines a value the
  # Ruby walk splits, leaving the head as it was.
  def test_the_c_walk_writes_plain_headers_and_declines_what_it_cannot_write_alike
    head = +"HTTP/1.1 200 OK\r\n"
    out = [nil]
    flags = NeverBlock::HTTPHead.response_headers(head, { "content-type" => "text/plain", "content-length" => "5" }, out)
    assert_equal 1, flags, "a content-length header"
    assert_equal "5", out[0]
    assert_equal "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n", head

    assert_nil NeverBlock::HTTPHead.response_headers(head, { "x-a" => "1", "x-b" => "a\nb" }, out)
    assert_equal "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 5\r\n", head, "unchanged"
    assert_equal 2 | 4 | 8, NeverBlock::HTTPHead.response_headers(+"", { "Transfer-Encoding" => "chunked", "DATE" => "x", "connection" => "Close" }, out)
  end

  # What the C walk leaves to the Ruby walk, whose calls the headers might
  # answer their own way (see RESPONSES).
  def test_the_c_walk_declines_headers_that_answer_the_ruby_walks_calls_their_own_way
    out = [nil]
    assert_equal 0, NeverBlock::HTTPHead.response_headers(+"", Rack::Headers.new.merge!("x-a" => "1"), out)
    [UpcasedHeaders.new.merge!("x-a" => "1"), RESPONSES.fetch("headers with an each of their own")[1],
     [%w[x-a 1]], { "x-a" => LoudString.new("1") }, { KeptName.new("x-a") => "1" },
     { "x-a" => ReversedArray.new(["1"]) }, { "x a" => "1" }].each do |headers|
      head = +"HTTP/1.1 200 OK\r\n"
      assert_nil NeverBlock::HTTPHead.response_headers(head, headers, out), headers.inspect
      assert_equal "HTTP/1.1 200 OK\r\n", head
    end
  end

  # A name with CR, LF or NUL would split the response: it is left out,
  # whichever walk writes the head, and so is it from a partial hijack's.
  def test_a_name_that_would_split_the_head_is_left_out
    headers = { "x-ok" => "1", "x\r\nset-cookie: evil=1" => "2", "x\nlf" => "3", "x\0nul" => "4" }
    [true, false].each do |fast|
      bytes, = written(GET, [200, headers, ["ok"]], true, fast: fast)
      head = bytes.split("\r\n\r\n", 2).first
      assert_includes head, "x-ok: 1"
      refute_match(/evil|lf|nul/, head, "fast: #{fast}")
    end
    reader, writer = UNIXSocket.pair
    Response.new(writer, 5, true).write_head(101, headers.merge("upgrade" => "websocket"))
    writer.close
    refute_match(/evil|lf|nul/, reader.read)
  ensure
    reader&.close
  end

  # Names are compared in ASCII whatever the locale: glibc's strncasecmp
  # follows the process's (Ruby sets it from the environment), and in a
  # Turkish one "I" is not "i", so TRANSFER-ENCODING was not seen (the
  # server's content-length went out beside it) nor CONNECTION: close.
  def test_framing_names_are_read_alike_in_a_turkish_locale
    source = "/usr/share/i18n/locales/tr_TR"
    skip "no localedef or #{source} here" unless File.exist?(source) && system("command -v localedef >/dev/null 2>&1")
    Dir.mktmpdir do |dir|
      _, status = Open3.capture2e("localedef", "-i", "tr_TR", "-f", "UTF-8", File.join(dir, "tr_TR.UTF-8"))
      skip "localedef could not build tr_TR.UTF-8" unless status.success? || File.directory?(File.join(dir, "tr_TR.UTF-8"))
      script = <<~RUBY
        require "neverblock/http_head"
        print NeverBlock::HTTPHead.response_headers(+"", { "TRANSFER-ENCODING" => "chunked", "CONNECTION" => "Close" }, [nil])
      RUBY
      out, err, status = Open3.capture3({ "LOCPATH" => dir, "LC_ALL" => "tr_TR.UTF-8" }, RbConfig.ruby, "-e", script)
      assert status.success?, err
      assert_equal (2 | 8).to_s, out, "transfer-encoding and connection: close, under tr_TR.UTF-8"
    end
  end

  private

  # The bytes `response` is written as, and write's answer (or the error it raised).
  def written(request, response, keep_alive, fast:)
    status, headers, body = response
    reader, writer = UNIXSocket.pair
    answer = Response.stub(:date_line, "date: Sat, 28 Nov 2026 12:00:00 GMT\r\n") do
      Response.new(writer, 5, fast).write(request, status, headers, body, keep_alive)
    rescue StandardError => e
      e.class
    end
    writer.close
    [reader.read, answer]
  ensure
    reader&.close
    writer&.close unless writer&.closed?
  end
end
