# frozen_string_literal: true

begin
  require "neverblock/monotonic" # Clock.now in C (ext/neverblock/monotonic)
rescue LoadError
  nil # not compiled (a `path:` gem): Clock.now below, the same reading
end

module NeverBlock
  # The one clock NeverBlock measures time with: monotonic, in seconds, unaffected by changes
  # to the wall clock (NTP steps, DST). Every deadline, timeout, age and duration in the
  # library is a difference of two {Clock.now} readings; wall-clock time appears only where a
  # human reads it (log timestamps).
  module Clock
    # (The C extension defines Clock.now when it is built: the same reading, without
    # Process.clock_gettime's lookup of its unit, which a hello-world request paid about
    # five times. Clock.now is on every request's path and every turn of the loop.)
    unless respond_to?(:now)
      module_function

      # @return [Float] seconds on the monotonic clock (an arbitrary origin: compare readings,
      #   never print one).
      def now
        Process.clock_gettime(Process::CLOCK_MONOTONIC)
      end
    end
  end
end
