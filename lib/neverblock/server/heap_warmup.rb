# frozen_string_literal: true

module NeverBlock
  class Server
    # Tidies the heap once the app is loaded, before the first request:
    # Ruby 3.3+'s `Process.warmup` (a full GC, compaction, every survivor
    # promoted to the old generation, empty pages freed, `malloc_trim`).
    # The app's boot objects then cost the minor GCs of every request
    # nothing, and a process that forks afterwards shares them unwritten.
    #
    # Who calls it: `neverblock serve` once the app is loaded (in the process
    # that serves with `-w 0`, in the master before forking with `--preload`,
    # else in each worker; `--no-warmup` leaves it out, and so does a
    # development environment unless asked, see {.wanted?}), the rackup handler
    # (`rails server -u neverblock`: the app is loaded before it runs), and
    # the refork mold before it forks the next generation ({Cluster::Mold}).
    module HeapWarmup
      module_function

      # @param setting [Boolean, nil] `--warmup`, `--no-warmup`, the config
      #   file's `warmup`, the handler's `Warmup=`; nil when none was given.
      # @return [Boolean] whether to warm up: as set, else unless
      #   RAILS_ENV (or RACK_ENV) is development, whose boots are many and
      #   short-lived.
      def wanted?(setting)
        return setting ? true : false unless setting.nil?

        (ENV["RAILS_ENV"] || ENV["RACK_ENV"]) != "development"
      end

      # Warms up a process whose app is loaded, logging the time it took.
      # @return [void]
      def boot
        seconds = call or return
        NeverBlock.logger.debug { "NeverBlock::Server: Process.warmup took #{(seconds * 1000).round} ms" }
      end

      # A master's `before_fork` hook that warms up last, after the app's
      # own (what that lets go is garbage the workers would share).
      # @param hook [#call, nil] the app's before_fork.
      # @return [Proc]
      def after(hook)
        lambda do
          hook&.call
          boot
        end
      end

      # @param fallback [Boolean] on a Ruby without `Process.warmup`, a full
      #   GC and `GC.compact` instead (the mold's children share the pages);
      #   without it, nothing.
      # @return [Float, nil] the seconds it took; nil when nothing ran.
      # @raise [BaseError] when the compaction moved what llhttp points at
      #   ({LLHttpPin.across_compaction}).
      def call(fallback: false)
        return nil unless Process.respond_to?(:warmup) || fallback

        started = Clock.now
        LLHttpPin.across_compaction do
          if Process.respond_to?(:warmup)
            Process.warmup
          else
            GC.start
            GC.compact if GC.respond_to?(:compact)
          end
        end
        Clock.now - started
      rescue NotImplementedError # GC.compact where the platform has no compaction
        nil
      end
    end
  end
end
