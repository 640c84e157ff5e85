# frozen_string_literal: true

# A thumbnail proxy in front of an S3-style origin (the 2009 NeverBlock
# thumbnail server, rebuilt): GET /thumb/<width>x<height>/<key> fetches
# <ORIGIN_URL>/<key> with Net::HTTP, resizes it with libvips off the event
# loop, and keeps the result in memory. README.md (next to this file) has
# the whole story; in short, from a checkout of NeverBlock after bin/setup:
#
#   export BUNDLE_PATH=vendor/bundle
#   ORIGIN_URL=https://my-bucket.s3.amazonaws.com \
#     bundle exec exe/neverblock serve examples/thumbnails/config.ru -p 9292
#   curl -si http://127.0.0.1:9292/thumb/200x150/photos/cat.jpg
#   curl -s http://127.0.0.1:9292/stats
#
# Settings (environment): ORIGIN_URL (required); ORIGIN_TIMEOUT (seconds a
# fetch may take, default 5); ORIGIN_CONCURRENCY (fetches at once, default
# 16); RESIZE_CONCURRENCY (resizes at once, default the number of CPUs);
# CACHE_MB (memory for thumbnails, default 64); MAX_SIZE (largest width or
# height, default 2000); MAX_AGE (Cache-Control max-age, default 86400).
# Each worker process has its own cache and counters.

require "etc"
require_relative "thumbnails"

origin_url = ENV.fetch("ORIGIN_URL") do
  raise "examples/thumbnails: set ORIGIN_URL to the origin's base URL, like https://my-bucket.s3.amazonaws.com"
end
origin = Thumbnails::Origin.new(origin_url, timeout: Float(ENV.fetch("ORIGIN_TIMEOUT", "5")),
                                            concurrency: Integer(ENV.fetch("ORIGIN_CONCURRENCY", "16")))
resizer = Thumbnails::Resizer.new(concurrency: Integer(ENV.fetch("RESIZE_CONCURRENCY", Etc.nprocessors.to_s)))

run Thumbnails::App.new(origin: origin, resizer: resizer,
                        cache_bytes: Integer(ENV.fetch("CACHE_MB", "64")) * 1024 * 1024,
                        max_size: Integer(ENV.fetch("MAX_SIZE", "2000")),
                        max_age: Integer(ENV.fetch("MAX_AGE", "86400")))
