# frozen_string_literal: true

# The thumbnail proxy's parts; config.ru (next to this file) puts them
# together and says how to run it.
#
#   client --GET /thumb/200x150/cat.jpg--> App --hit--> LruCache
#                                           | miss
#                                        Coalescer (one run per thumbnail in flight)
#                                           |
#              Origin (Net::HTTP over a ConnectionPool: fetches at once, timeout)
#                                           |
#              Resizer (FiberPool: resizes at once; NeverBlock.defer: libvips off the loop)
require "neverblock"
require_relative "thumbnails/lru_cache"
require_relative "thumbnails/coalescer"
require_relative "thumbnails/origin"
require_relative "thumbnails/resizer"
require_relative "thumbnails/app"
