# frozen_string_literal: true

require "llhttp"

module NeverBlock
  # Keeps what the llhttp gem's C code points at where it points.
  #
  # The llhttp gem (0.6) holds two kinds of bare references that the garbage
  # collector neither marks nor updates when it compacts the heap: each
  # parser's delegate, and the classes it looked up once at load
  # (`LLHttp::Error`, which every parse error is raised as). Once
  # `GC.compact`, `GC.auto_compact` or `Process.warmup` (which compacts, and
  # which `neverblock serve` and the refork mold call) moves one of them, the
  # next callback, or the next request llhttp refuses, reads freed memory and
  # the process segfaults. A key of an identity hash is pinned, since its hash
  # is its address: {PINNED} holds the classes so from the moment this file
  # is loaded, and a delegate holds such a hash with itself as the key, so it
  # stays where llhttp saw it for as long as it lives.
  #
  # Mixed into the LLHttp::Delegate subclasses that make parsers (the
  # server's request parser, the reverse proxy's upstream connection).
  module LLHttpPin
    # The module and classes llhttp's C code keeps from its load on.
    PINNED = { LLHttp => true, LLHttp::Parser => true, LLHttp::Error => true }.compare_by_identity.freeze

    private

    # @param type [Symbol] `:request` or `:response`.
    # @return [LLHttp::Parser] a parser calling back this object, now pinned.
    def pinned_llhttp(type)
      @llhttp_pin ||= { self => true }.compare_by_identity
      LLHttp::Parser.new(self, type: type)
    end
  end
end
