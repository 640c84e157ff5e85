# frozen_string_literal: true

# Builds neverblock/monotonic (NeverBlock::Clock.now in C, see monotonic.c)
# where clock_gettime(CLOCK_MONOTONIC) exists. Elsewhere it writes a Makefile
# that builds nothing, so the gem still installs: lib/neverblock/clock.rb
# then reads the clock through Process.clock_gettime, as before.
require "mkmf"

if have_header("time.h") && have_func("clock_gettime", "time.h") && have_const("CLOCK_MONOTONIC", "time.h")
  $CFLAGS << " -std=c99 -Wall -O2"
  create_makefile("neverblock/monotonic")
else
  File.write("Makefile", <<~MAKE)
    all install static install-so install-rb clean distclean:
    \t@:
    .PHONY: all install static install-so install-rb clean distclean
  MAKE
end
