# frozen_string_literal: true

require "digest/sha2"
require "vips"

module Thumbnails
  # A thumbnail: the image's bytes and what the response says about them.
  Thumbnail = Struct.new(:body, :content_type, :etag, :width, :height, keyword_init: true)

  # Makes thumbnails with libvips (the ruby-vips gem), off the event loop.
  #
  # Decoding and scaling an image is CPU work: done in a request's fiber it
  # would hold the loop, and every other request of the process would wait
  # for it. So each resize runs in NeverBlock.defer, on the loop's thread
  # pool, and only the fiber that asked waits. libvips releases Ruby's GVL
  # while it computes (ruby-vips calls it with ffi's `blocking: true`), so
  # the loop thread goes on running Ruby meanwhile.
  #
  # At most `concurrency` resizes run at once (a NeverBlock::FiberPool):
  # each one holds a decoded image in memory, and the thread pool stays free
  # for other deferred work and DNS. Up to `queue_limit` more wait their
  # turn; beyond that {#resize} raises NeverBlock::PoolFull (the app answers
  # 503) instead of queueing without bound.
  class Resizer
    # The original could not be decoded (the app answers 502).
    class NotAnImage < StandardError; end

    # Output formats by file extension: vips' saver suffix, content type, saver options.
    FORMATS = {
      "jpg" => [".jpg", "image/jpeg", { Q: 85 }],
      "jpeg" => [".jpg", "image/jpeg", { Q: 85 }],
      "png" => [".png", "image/png", {}],
      "webp" => [".webp", "image/webp", { Q: 80 }]
    }.freeze

    # @return [Integer] resizes started since the start.
    attr_reader :resizes

    # @param concurrency [Integer] resizes at once (>= 1).
    # @param queue_limit [Integer] resizes that may wait for a turn.
    def initialize(concurrency: 2, queue_limit: 100)
      @pool = NeverBlock::FiberPool.new(size: concurrency, queue_limit: queue_limit)
      @resizes = 0
    end

    # Scales `original` down to fit within `width` x `height`, keeping its
    # aspect ratio; an image already that small keeps its size.
    #
    # @param original [String] the image's bytes (any format libvips reads).
    # @param width [Integer]
    # @param height [Integer]
    # @param format [String] a key of {FORMATS}.
    # @return [Thumbnail]
    # @raise [NotAnImage] when libvips cannot decode `original`.
    # @raise [NeverBlock::PoolFull] when `queue_limit` resizes already wait.
    def resize(original, width, height, format)
      suffix, content_type, options = FORMATS.fetch(format)
      task = @pool.spawn do
        @resizes += 1 # here, on the loop thread: only the loop thread writes it
        NeverBlock.defer { render(original, width, height, suffix, options) }
      end
      body, actual_width, actual_height = task.value
      Thumbnail.new(body: body, content_type: content_type, width: actual_width, height: actual_height,
                    etag: %("#{Digest::SHA256.hexdigest(body)[0, 32]}"))
    end

    # @return [Hash] the FiberPool's `{size:, busy:, idle:, queued:, completed:}`.
    def stats
      @pool.stats
    end

    private

    # Runs on a pool thread.
    # @return [Array(String, Integer, Integer)] the encoded thumbnail, its width and height.
    def render(original, width, height, suffix, options)
      # thumbnail_buffer decodes at a reduced size where the format allows
      # (JPEG, WebP shrink on load), so a large original costs less.
      image = Vips::Image.thumbnail_buffer(original, width, height: height, size: :down)
      image = image.flatten(background: [255]) if image.has_alpha? && suffix == ".jpg" # JPEG has no alpha
      [image.write_to_buffer(suffix, **options), image.width, image.height]
    rescue Vips::Error => e
      raise NotAnImage, "libvips cannot read the original: #{e.message.lines.first&.strip}"
    end
  end
end
