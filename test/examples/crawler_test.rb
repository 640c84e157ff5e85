# frozen_string_literal: true

require_relative "../test_helper"
require "neverblock/server"
require_relative "../../examples/crawler"

# examples/crawler.rb against a real site: a NeverBlock::Server on
# 127.0.0.1 whose pages link to each other, to a 404, to a page that takes
# 3 s, and to another server that must never be asked for anything.
class CrawlerExampleTest < PlainTest
  # Seconds every ordinary page takes to answer, the slow page's, and the
  # crawler's limit per page: far apart, so that a loaded machine (the
  # suite on 2 cores beside other work) cannot blur a timeout with an answer.
  PAGE_DELAY = 0.3
  SLOW_PAGE_DELAY = 10
  PAGE_TIMEOUT = 2

  # path => the links on that page (OTHER is replaced by the other server's root).
  LINKS = {
    "/" => ["/a", "/b", "/c", "/a#top", "/missing", "/slow", "OTHER", "mailto:someone@example.com"],
    "/a" => ["/a1", "/a2", "/", "/b"],
    "/b" => ["/b1", "/b2", "/c"],
    "/c" => ["/c1", "/a"],
    "/a1" => ["/deep"], "/a2" => ["/"], "/b1" => ["/"], "/b2" => ["/deep"], "/c1" => ["/", "/a"],
    "/deep" => []
  }.freeze

  # Every URL of the site within depth 2 of "/".
  WITHIN_DEPTH_2 = %w[/ /a /b /c /missing /slow /a1 /a2 /b1 /b2 /c1].freeze

  def setup
    @requests = Hash.new(0) # path => requests the site got
    @in_flight = 0          # ordinary pages being answered now
    @most_in_flight = 0
    @servers = []
    @other_requests = 0
    @other = start_server(->(_env) { @other_requests += 1; [200, { "content-type" => "text/html" }, ["other"]] })
    @site = start_server(method(:site))
  end

  def teardown
    @servers.each do |server, thread|
      server.stop
      assert thread.join(20), "server did not stop"
    end
    super
  end

  def test_crawls_every_same_host_url_once_concurrently_and_times_out_the_slow_page
    out = StringIO.new
    report = nil
    seconds = elapsed { report = crawler("/", out: out).run }

    assert_equal WITHIN_DEPTH_2.to_h { |path| [path, 1] }, @requests, "every URL within depth 2, each fetched once"
    assert_equal 0, @other_requests, "a link to another host is not followed"
    assert_equal (WITHIN_DEPTH_2.map { |path| url(path) }).sort, report.pages.map(&:url).sort

    slow = report.pages.find { |page| page.url == url("/slow") }
    assert slow.timeout?, "the slow page is reported as a timeout: #{slow.inspect}"
    assert_operator slow.seconds, :>=, PAGE_TIMEOUT * 0.9
    assert_operator slow.seconds, :<, 6, "the timeout fired at ~#{PAGE_TIMEOUT} s, not after the page's #{SLOW_PAGE_DELAY} s"

    assert_equal [url("/missing"), url("/slow")], report.failed.map(&:url).sort
    assert_equal 404, report.pages.find { |page| page.url == url("/missing") }.status
    assert_equal 1, report.exit_status
    root = report.pages.find { |page| page.url == url("/") }
    assert_equal 6, root.links.size, "the root's links: absolute, without #fragments, other hosts included"

    # 9 pages of PAGE_DELAY, a 404 and a timeout, in 3 levels: ~2.6 s when
    # concurrent, ~4.7 s one by one; only the number in flight says which
    # on a loaded machine.
    assert_operator @most_in_flight, :>=, 3, "pages fetched concurrently"
    assert_operator seconds, :<, 8, "the crawl did not wait for the slow page (#{SLOW_PAGE_DELAY} s)"

    lines = out.string.lines
    assert_equal WITHIN_DEPTH_2.size + 1, lines.size, out.string
    assert_match(/\ATIMEOUT +\d+\.\d+ s +0 links +#{Regexp.escape(url('/slow'))}$/, lines.grep(/slow/).first)
    assert_match(/\A404 +\d\.\d+ s +0 links +#{Regexp.escape(url('/missing'))}$/, lines.grep(/missing/).first)
    assert_match(/\A200 +\d\.\d+ s +6 links +#{Regexp.escape(url('/'))}$/, lines.grep(/ #{Regexp.escape(url('/'))}$/).first)
    assert_match(/\A11 pages in \d\.\d\d s .*: 9 ok, 2 failed \((1 timeout, 1 HTTP 404|1 HTTP 404, 1 timeout)\)$/,
                 lines.last)
  end

  def test_no_more_requests_at_once_than_the_concurrency
    report = crawler("/", concurrency: 2).run
    assert_equal WITHIN_DEPTH_2.size, report.pages.size
    assert_equal 2, @most_in_flight, "ordinary pages answered at once (the slow one aside)"
  end

  def test_depth_0_fetches_the_start_page_only
    report = crawler("/a", depth: 0).run
    assert_equal [url("/a")], report.pages.map(&:url)
    assert_equal({ "/a" => 1 }, @requests)
    assert_equal 0, report.exit_status
  end

  def test_the_script_prints_a_line_per_page_and_exits_1_when_a_page_failed
    stdout, stderr, status = ruby_child("examples/crawler.rb", url("/"), "--depth", "2", "--concurrency", "8",
                                        "--timeout", PAGE_TIMEOUT.to_s)
    assert_equal 1, status.exitstatus, stderr
    assert_equal WITHIN_DEPTH_2.size + 1, stdout.lines.size, stdout
    assert_match(/^TIMEOUT .*#{Regexp.escape(url('/slow'))}$/, stdout)
    assert_match(/^11 pages in .*: 9 ok, 2 failed/, stdout.lines.last)
  end

  def test_the_script_exits_0_when_every_page_answered
    stdout, stderr, status = ruby_child("examples/crawler.rb", url("/c1"), "--depth", "1")
    assert_equal 0, status.exitstatus, stdout + stderr
    assert_match(/^3 pages in .*: 3 ok, 0 failed$/, stdout.lines.last)
  end

  def test_the_script_explains_a_bad_command_line
    _stdout, stderr, status = ruby_child("examples/crawler.rb", "ftp://example.com/")
    assert_equal 2, status.exitstatus
    assert_match(/not an http\(s\) URL: ftp:/, stderr)
    assert_match(/Usage: ruby -Ilib examples\/crawler.rb URL/, stderr)
  end

  private

  def crawler(path, depth: 2, concurrency: 8, out: nil)
    Crawler.new(url(path), depth: depth, concurrency: concurrency, timeout: PAGE_TIMEOUT, out: out)
  end

  def url(path)
    "http://127.0.0.1:#{@site}#{path}"
  end

  # The site: counts requests, answers ordinary pages after PAGE_DELAY.
  def site(env)
    path = env["PATH_INFO"]
    @requests[path] += 1
    return [404, { "content-type" => "text/html" }, ["<h1>not found</h1>"]] if path == "/missing"

    if path == "/slow"
      sleep SLOW_PAGE_DELAY
      return [200, { "content-type" => "text/html" }, ["finally"]]
    end
    links = LINKS.fetch(path) { return [404, { "content-type" => "text/html" }, ["no #{path}"]] }
    begin
      @in_flight += 1
      @most_in_flight = [@most_in_flight, @in_flight].max
      sleep PAGE_DELAY
    ensure
      @in_flight -= 1
    end
    anchors = links.map do |link|
      href = link == "OTHER" ? "http://127.0.0.1:#{@other}/" : link
      %(<a class="link" href="#{href}">#{href}</a>)
    end
    [200, { "content-type" => "text/html; charset=utf-8" }, ["<html><body>#{anchors.join("\n")}</body></html>"]]
  end

  # A NeverBlock::Server on 127.0.0.1, in a thread of its own.
  # @return [Integer] its port.
  def start_server(app)
    server = NeverBlock::Server.new(app, bind: ["tcp://127.0.0.1:0"], workers: 0, shutdown_timeout: 1)
    port = Integer(server.bound_addresses.first[/\d+\z/])
    @servers << [server, Thread.new { server.run }]
    port
  end
end
