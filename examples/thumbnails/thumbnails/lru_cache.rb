# frozen_string_literal: true

module Thumbnails
  # Thumbnails kept in memory, bounded by their total size in bytes: when a
  # new one would take the total over `max_bytes`, the least recently used
  # go first. A thumbnail larger than `max_bytes` on its own is not kept.
  #
  # Not locked: every caller runs on the one event loop thread of its
  # process, and nothing here waits, so no other fiber can run in between.
  class LruCache
    # @return [Integer] the most bytes kept.
    attr_reader :max_bytes

    # @return [Integer] bytes kept now.
    attr_reader :bytes

    # @param max_bytes [Integer] >= 0; 0 keeps nothing.
    def initialize(max_bytes:)
      raise ArgumentError, "max_bytes must be an Integer >= 0, got #{max_bytes.inspect}" unless
        max_bytes.is_a?(Integer) && max_bytes >= 0

      @max_bytes = max_bytes
      @bytes = 0
      @entries = {} # key => [value, bytes], least recently used first (a Hash keeps insertion order)
    end

    # @param key [String]
    # @return [Object, nil] the value, now the most recently used; nil when absent.
    def [](key)
      entry = @entries.delete(key) or return nil

      @entries[key] = entry
      entry[0]
    end

    # Keeps `value` (replacing an older value of `key`) and evicts the least
    # recently used values until the total is within `max_bytes`.
    # @param key [String]
    # @param value [Object]
    # @param bytes [Integer] what `value` counts for.
    # @return [Boolean] whether it was kept.
    def store(key, value, bytes)
      delete(key)
      return false if bytes > @max_bytes

      @entries[key] = [value, bytes]
      @bytes += bytes
      delete(@entries.first[0]) while @bytes > @max_bytes
      true
    end

    # @param key [String]
    # @return [void]
    def delete(key)
      _, bytes = @entries.delete(key)
      @bytes -= bytes if bytes
    end

    # @return [Integer] values kept now.
    def size
      @entries.size
    end
  end
end
