# frozen_string_literal: true

module NeverBlock
  # The one clock NeverBlock measures time with: monotonic, in seconds, unaffected by changes
  # to the wall clock (NTP steps, DST). Every deadline, timeout, age and duration in the
  # library is a difference of two {Clock.now} readings; wall-clock time appears only where a
  # human reads it (log timestamps).
  module Clock
    module_function

    # @return [Float] seconds on the monotonic clock (an arbitrary origin: compare readings,
    #   never print one).
    def now
      Process.clock_gettime(Process::CLOCK_MONOTONIC)
    end
  end
end
