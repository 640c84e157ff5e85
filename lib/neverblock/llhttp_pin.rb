# frozen_string_literal: true

llhttp_loaded_before = defined?(LLHttp::Parser) ? true : false
begin
  require "llhttp"
rescue LoadError => e
  raise LoadError, "NeverBlock parses HTTP with the llhttp gem: add `gem \"llhttp\", \"~> 0.6\"` to your Gemfile " \
                   "(#{e.message})"
end

module NeverBlock
  # Keeps what the llhttp gem's C code points at where it points, so that a
  # heap compaction cannot crash the process.
  #
  # llhttp (0.6.2 and earlier) keeps two references in C that Ruby's garbage
  # collector neither marks nor updates when it compacts the heap: the class
  # it raises every parse error as (`LLHttp::Error`, looked up once when the
  # gem loads), and each parser's delegate (the object whose `on_*` methods
  # it calls). `GC.compact`, `GC.auto_compact` and `Process.warmup` (which
  # compacts, and which `neverblock serve` and the refork mold call) may move
  # either. After that, the next message llhttp refuses, or the next
  # callback, reads memory that no longer holds that object: a segfault, or
  # a call on whatever object lives there now.
  #
  # An identity hash's keys are never moved (their hash is their address).
  # So {PINNED} holds LLHttp::Error as such a key from the moment this file
  # loads (it is loaded with `neverblock`, early in an app's boot), and
  # every LLHttp::Parser, whoever makes it (NeverBlock's server and reverse
  # proxy, the `http` gem), holds its delegate so for as long as it lives.
  # {.across_compaction} checks, around NeverBlock's own compactions, that
  # this still holds on the Ruby it runs on.
  module LLHttpPin
    # The module and classes llhttp's C code looked up when it loaded (it
    # raises LLHttp::Error after that).
    PINNED = { LLHttp => true, LLHttp::Parser => true, LLHttp::Error => true }.compare_by_identity.freeze

    # Prepended to LLHttp::Parser.
    module Parser
      # @param delegate [LLHttp::Delegate] what the C parser calls back.
      def initialize(delegate, **options)
        @neverblock_pin = { delegate => true }.compare_by_identity
        super
      end
    end

    class << self
      # Runs the block (a compaction) and checks that LLHttp::Error stayed
      # where llhttp's C code points.
      # @return [Object] the block's value.
      # @raise [BaseError] when it moved all the same: this Ruby no longer
      #   pins an identity hash's keys, and the next request llhttp refuses
      #   would crash the process. `--no-warmup` avoids the compaction.
      def across_compaction
        before = address(LLHttp::Error)
        value = yield
        return value if address(LLHttp::Error) == before

        raise BaseError, "LLHttp::Error moved in a heap compaction although NeverBlock pins it (Ruby " \
                         "#{RUBY_VERSION}): llhttp would crash at its next parse error. Serve without " \
                         "Process.warmup (--no-warmup, `warmup false`, -O Warmup=false) and report this"
      end

      # @param loaded_before [Boolean] whether llhttp was loaded before this file.
      # @return [String, nil] a warning when llhttp was loaded and the heap
      #   compacted before NeverBlock could pin its error class.
      def late_warning(loaded_before)
        return unless loaded_before && GC.stat.fetch(:compact_count, 0).positive?

        "NeverBlock: llhttp was loaded and the heap compacted before `neverblock` was required: llhttp may " \
          "crash at its next parse error. Require neverblock before llhttp (or the http gem), or compact later."
      end

      private

      # Where `object` is in the heap (Kernel#to_s, which every object has
      # whatever its class defines).
      def address(object)
        Kernel.instance_method(:to_s).bind_call(object)[/0x\h+/]
      end
    end
  end
end

LLHttp::Parser.prepend(NeverBlock::LLHttpPin::Parser)
(warning = NeverBlock::LLHttpPin.late_warning(llhttp_loaded_before)) && warn(warning)
