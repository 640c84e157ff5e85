# frozen_string_literal: true

require_relative "lib/neverblock/version"

Gem::Specification.new do |spec|
  spec.name = "neverblock"
  spec.version = NeverBlock::VERSION
  spec.authors = ["NeverBlock contributors"]
  spec.summary = "Fiber-scheduler concurrency for blocking-style Ruby"
  spec.description = <<~DESC
    NeverBlock runs ordinary blocking-style Ruby (Net::HTTP, sockets, DNS, sleep,
    Timeout, subprocesses, database drivers) concurrently in fibers on Ruby's
    Fiber::Scheduler interface, with tasks, a reusable fiber pool, timeouts,
    a stall detector and test helpers; fibered PostgreSQL and MySQL pools and
    ActiveRecord adapters; a preforking fiber-per-request Rack server with the
    `neverblock` command; and a request debouncer. The 2.0 line, a rewrite of
    the 2009 NeverBlock (0.1.x, EventMachine) on Fiber::Scheduler.
  DESC
  spec.homepage = "https://github.com/neverblock/neverblock"
  spec.license = "MIT"
  spec.required_ruby_version = ">= 3.1"
  spec.metadata = {
    "homepage_uri" => spec.homepage,
    "source_code_uri" => spec.homepage,
    "changelog_uri" => "#{spec.homepage}/blob/main/CHANGELOG.md",
    "bug_tracker_uri" => "#{spec.homepage}/issues",
    "documentation_uri" => "#{spec.homepage}#readme",
    "rubygems_mfa_required" => "true"
  }

  spec.files = Dir["lib/**/*.rb", "ext/**/*.{c,rb}", "exe/*", "README.md", "docs/*.md", "CHANGELOG.md", "LICENSE"]
  # NeverBlock::Epoll, which lets the server hold idle keep-alive connections
  # without a fiber each; built on Linux only (elsewhere extconf.rb builds
  # nothing and the server keeps a fiber per idle connection).
  # NeverBlock::HTTPHead, the server's request head -> env fast path in C
  # (without it every head goes through llhttp's Ruby callbacks).
  # NeverBlock::Clock.now in C (without it, Process.clock_gettime).
  spec.extensions = ["ext/neverblock/epoll/extconf.rb", "ext/neverblock/http_head/extconf.rb",
                     "ext/neverblock/monotonic/extconf.rb"]
  spec.bindir = "exe"
  spec.executables = ["neverblock"]
  spec.require_paths = ["lib"]

  spec.add_dependency "io-event", "~> 1.11"
  # The HTTP parser of NeverBlock::Server (llhttp's C parser; no dependencies of its own).
  spec.add_dependency "llhttp", "~> 0.6.2"
  # `neverblock serve` loads config.ru with Rack::Builder; the server speaks Rack 3 (and 2.2).
  spec.add_dependency "rack", ">= 2.2.4", "< 4"
end
