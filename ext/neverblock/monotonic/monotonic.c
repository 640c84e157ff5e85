// NeverBlock::Clock.now: seconds on the monotonic clock, as a Float, the
// reading every deadline, timeout and duration in NeverBlock is made of
// (lib/neverblock/clock.rb, which falls back to Process.clock_gettime when
// this is not built).
//
// Process.clock_gettime(Process::CLOCK_MONOTONIC) gives the same reading,
// but on its way it parses its arguments and looks up the unit it was not
// given among seven Symbols: a hello-world request reads the clock about
// five times, and on Ruby 3.4 + YJIT that took some 220 instructions a
// reading (callgrind), most of them in the unit lookup. This is one system
// call through the vDSO and a Float: a flonum on 64-bit platforms, so
// nothing is allocated. The Float is computed as Ruby computes it (seconds
// in nanoseconds, then divided), so that the two readings of one instant
// are the same Float.
#include <ruby.h>
#include <time.h>

// @return [Float] seconds on the monotonic clock (an arbitrary origin).
static VALUE nb_clock_now(VALUE self) {
    struct timespec ts;
    (void)self;
    if (clock_gettime(CLOCK_MONOTONIC, &ts) != 0) rb_sys_fail("clock_gettime(CLOCK_MONOTONIC)");
    return DBL2NUM(((double)ts.tv_sec * 1e9 + (double)ts.tv_nsec) / 1e9);
}

void Init_monotonic(void) {
    VALUE neverblock = rb_define_module("NeverBlock");
    VALUE clock = rb_define_module_under(neverblock, "Clock");
    rb_define_module_function(clock, "now", nb_clock_now, 0);
}
