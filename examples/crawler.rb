# frozen_string_literal: true

# A web crawler in plain blocking Ruby: Net::HTTP fetches the pages,
# NeverBlock.map fetches each level of the crawl with at most --concurrency
# requests at once, and NeverBlock.timeout gives every page --timeout seconds.
#
# From the start URL it follows links to the same host and port, breadth
# first, down to --depth levels (0: the start page only), fetching every URL
# once. It prints a line per page as the page completes (status, seconds,
# links found, URL), then a summary, and exits 1 if a page failed (an HTTP
# status of 400 or more, a timeout, a connection error), 0 otherwise.
#
# Run it from a checkout of NeverBlock, against any site:
#
#   ruby -Ilib examples/crawler.rb http://127.0.0.1:9292/ --depth 2 --concurrency 8 --timeout 2
#
# or from Ruby, as test/examples/crawler_test.rb does:
#
#   require_relative "examples/crawler"
#   report = Crawler.new("http://127.0.0.1:9292/", depth: 2, concurrency: 8, timeout: 2).run
#   report.failed # => the Crawler::Pages that failed

require "neverblock"
require "net/http"
require "cgi"
require "optparse"
require "set"
require "uri"

# Crawls one site; {#run} returns a {Crawler::Report}.
class Crawler
  # One fetched URL. `status` is the HTTP status (nil when there was no
  # response); `error` says why there was none ("timeout", or the
  # exception); `seconds` is the fetch's wall time; `links` are the absolute
  # URLs the page links to (any host), a redirect's Location included.
  Page = Struct.new(:url, :depth, :status, :error, :seconds, :links, keyword_init: true) do
    def failed?
      !error.nil? || status >= 400
    end

    def timeout?
      error == "timeout"
    end
  end

  # The crawl's pages (in the order they completed) and its wall time.
  Report = Struct.new(:pages, :seconds, keyword_init: true) do
    def failed
      pages.select(&:failed?)
    end

    # @return [Integer] what the script exits with: 1 if a page failed.
    def exit_status
      failed.empty? ? 0 : 1
    end
  end

  # An `<a ... href=...>` attribute, double-quoted, single-quoted or bare.
  HREF = /<a\s[^>]*?\bhref\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))/i

  # @param start_url [String] an http:// or https:// URL.
  # @param depth [Integer] levels of links to follow (0: the start page only).
  # @param concurrency [Integer] requests at once, at most.
  # @param timeout [Numeric] seconds each page gets, connecting included.
  # @param max_pages [Integer] URLs fetched at most (a guard against endless sites).
  # @param out [IO, nil] where the page lines and the summary go; nil: nowhere.
  # @raise [ArgumentError] for a URL that is not http(s) or a bad option.
  def initialize(start_url, depth: 2, concurrency: 8, timeout: 2, max_pages: 1000, out: $stdout)
    @root = URI(start_url)
    raise ArgumentError, "not an http(s) URL: #{start_url}" unless @root.is_a?(URI::HTTP) && @root.host

    @root.path = "/" if @root.path.empty?
    @depth = NeverBlock.validate_size!(depth, :depth, minimum: 0)
    @concurrency = NeverBlock.validate_size!(concurrency, :concurrency)
    @timeout = NeverBlock.validate_timeout!(timeout, :timeout)
    @max_pages = NeverBlock.validate_size!(max_pages, :max_pages)
    @out = out
  end

  # Crawls: one level at a time, each level's URLs fetched concurrently
  # (NeverBlock.map), so a level takes about as long as its slowest page
  # (at most `timeout`), not as long as all of them.
  # @return [Report]
  def run
    started = now
    pages = []
    NeverBlock.run do
      seen = Set[@root.to_s]
      frontier = [@root.to_s]
      (0..@depth).each do |level|
        fetched = NeverBlock.map(frontier, concurrency: @concurrency) { |url| report(fetch(url, level)) }
        pages.concat(fetched)
        break if level == @depth

        frontier = fetched.flat_map(&:links).select { |url| same_site?(url) && seen.add?(url) }
        frontier = frontier.first(@max_pages - pages.size)
        break if frontier.empty?
      end
    end
    Report.new(pages: pages, seconds: now - started).tap { |result| summarize(result) }
  end

  private

  # Never raises for a page's own failure: NeverBlock.map would cancel the
  # rest of the level. (A cancellation, Ctrl-C, still ends the crawl.)
  def fetch(url, level)
    started = now
    response = NeverBlock.timeout(@timeout) { get(URI(url)) }
    Page.new(url: url, depth: level, status: response.code.to_i, seconds: now - started,
             links: links_in(url, response))
  rescue NeverBlock::TimeoutError
    Page.new(url: url, depth: level, error: "timeout", seconds: now - started, links: [])
  rescue NeverBlock::Cancelled
    raise
  rescue StandardError => e # refused, reset, DNS, TLS, a malformed response: this page failed
    Page.new(url: url, depth: level, error: "#{e.class}: #{e.message}", seconds: now - started, links: [])
  end

  # A blocking GET: inside NeverBlock it suspends only this fiber.
  def get(uri)
    Net::HTTP.start(uri.host, uri.port, use_ssl: uri.scheme == "https") do |http|
      http.request_get(uri.request_uri, "user-agent" => "NeverBlock-example-crawler/#{NeverBlock::VERSION}")
    end
  end

  def links_in(url, response)
    hrefs = if response.is_a?(Net::HTTPRedirection)
              [response["location"]].compact
            elsif response.content_type == "text/html"
              response.body.to_s.scan(HREF).map { |groups| CGI.unescapeHTML(groups.compact.first) }
            else
              []
            end
    hrefs.filter_map { |href| absolute(url, href) }.uniq
  end

  # The link as an absolute http(s) URL without its #fragment, or nil
  # (mailto:, javascript:, unparsable).
  def absolute(base, href)
    uri = URI.join(base, href.strip)
    return nil unless uri.is_a?(URI::HTTP) && uri.host

    uri.fragment = nil
    uri.path = "/" if uri.path.empty?
    uri.to_s
  rescue URI::Error
    nil
  end

  def same_site?(url)
    uri = URI(url)
    uri.scheme == @root.scheme && uri.host.casecmp?(@root.host) && uri.port == @root.port
  end

  def report(page)
    label = page.timeout? ? "TIMEOUT" : page.error ? "ERROR" : page.status.to_s
    line = format("%-7s %6.3f s %4d links  %s", label, page.seconds, page.links.size, page.url)
    line << "  (#{page.error})" if page.error && !page.timeout?
    @out&.puts(line)
    page
  end

  def summarize(result)
    return unless @out

    failed = result.failed
    reasons = failed.group_by { |page| page.timeout? ? "timeout" : page.error ? "error" : "HTTP #{page.status}" }
    detail = reasons.map { |reason, pages| "#{pages.size} #{reason}" }.join(", ")
    @out.puts(format("%d pages in %.2f s (depth %d, concurrency %d, timeout %s s): %d ok, %d failed%s",
                     result.pages.size, result.seconds, @depth, @concurrency, @timeout,
                     result.pages.size - failed.size, failed.size, detail.empty? ? "" : " (#{detail})"))
  end

  def now
    Process.clock_gettime(Process::CLOCK_MONOTONIC)
  end

  # The command line: `crawler.rb URL [options]`.
  # @return [Integer] the exit status.
  def self.main(argv, out: $stdout, err: $stderr)
    options = { depth: 2, concurrency: 8, timeout: 2.0, max_pages: 1000 }
    parser = OptionParser.new do |o|
      o.banner = "Usage: ruby -Ilib examples/crawler.rb URL [options]"
      o.on("--depth N", Integer, "levels of links to follow (default 2; 0: the start page only)") { |n| options[:depth] = n }
      o.on("--concurrency N", Integer, "requests at once (default 8)") { |n| options[:concurrency] = n }
      o.on("--timeout SECONDS", Float, "per page (default 2)") { |s| options[:timeout] = s }
      o.on("--max-pages N", Integer, "stop following links after N pages (default 1000)") { |n| options[:max_pages] = n }
    end
    urls = parser.parse(argv)
    raise OptionParser::InvalidArgument, "one URL, got #{urls.size}" unless urls.size == 1

    new(urls.first, **options, out: out).run.exit_status
  rescue OptionParser::ParseError, ArgumentError, URI::Error => e
    err.puts("crawler: #{e.message}\n\n#{parser}")
    2
  end
end

exit(Crawler.main(ARGV)) if $PROGRAM_NAME == __FILE__
