# frozen_string_literal: true

require "fiddle"

module NeverBlockFuzz
  # AddressSanitizer's interface, when the process runs with its runtime
  # (bin/fuzz preloads it); each method does nothing without it.
  module Sanitizer
    def self.function(name, arguments, result)
      Fiddle::Function.new(Fiddle::Handle::DEFAULT[name], arguments, result)
    rescue Fiddle::DLError
      nil
    end

    ALLOCATED = function("__sanitizer_get_current_allocated_bytes", [], Fiddle::TYPE_SIZE_T)
    UNPOISON = function("__asan_unpoison_memory_region", [Fiddle::TYPE_VOIDP, Fiddle::TYPE_SIZE_T], Fiddle::TYPE_VOID)

    module_function

    # @return [Integer, nil] bytes allocated and not freed yet.
    def allocated_bytes
      ALLOCATED&.call
    end

    # The main thread's stack, as far as it may grow: its mapping's top, less
    # the stack size limit (64 MiB when unlimited).
    STACK_TOP = Integer(File.read("/proc/self/maps")[/^\h+-(\h+) .*\[stack\]$/, 1], 16)
    STACK_SIZE = [Process.getrlimit(:STACK).first, 64 << 20].min

    # Runs the block, a call into an instrumented extension that may raise,
    # and then clears what that call's frames left marked on the stack.
    #
    # An instrumented function marks redzones around its addressable locals
    # (`StringValue(data)` makes `data` one) and clears them as it returns.
    # Ruby raises with __builtin_longjmp, which ASan does not see, so an
    # exception raised under such a frame by a call the compiler does not
    # know cannot return (NUM2LONG, NUM2INT, StringValue) leaves its redzones
    # marked; Ruby's own code, using that stack later (a memcpy into a
    # buffer there, the GC's clock_gettime), is then reported. (rb_raise and
    # rb_sys_fail are declared noreturn: ASan clears the stack before them.)
    # The extensions raise that way only when misused (a non-Integer offset
    # or descriptor), which the targets do on purpose, through this method.
    # The GC is off until the stack is cleared: the reports seen came from
    # a GC that an allocation on the way out of the block started.
    def raising_through_c
      disabled = GC.disable
      yield
    ensure
      UNPOISON&.call(STACK_TOP - STACK_SIZE, STACK_SIZE)
      GC.enable unless disabled
    end
  end
end
