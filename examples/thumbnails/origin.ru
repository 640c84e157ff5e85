# frozen_string_literal: true

# A stand-in for S3 to try examples/thumbnails with: serves the files of
# IMAGES_DIR (default: the current directory) at /<path>, 404 for the rest.
#
#   IMAGES_DIR=~/Pictures bundle exec exe/neverblock serve examples/thumbnails/origin.ru -p 9000 -w 0
#   ORIGIN_URL=http://127.0.0.1:9000 bundle exec exe/neverblock serve examples/thumbnails/config.ru -p 9292

require "rack/files"

run Rack::Files.new(File.expand_path(ENV.fetch("IMAGES_DIR", ".")))
