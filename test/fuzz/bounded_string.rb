# frozen_string_literal: true

require "fiddle"

module NeverBlockFuzz
  # Strings whose bytes end exactly where their buffer ends. A Ruby String
  # keeps a NUL after its bytes, in a buffer of its own or in the object's
  # slot (short strings), so a C extension that reads one byte too far
  # reads that NUL, and AddressSanitizer sees nothing. A bounded string's
  # bytes are the last of a malloc'd block (Fiddle::Pointer.malloc) wrapped
  # by rb_str_new_static, which copies nothing: under ASan the next byte is
  # a redzone, and a read of it is reported.
  #
  # The block is freed when its Fiddle::Pointer is collected: keep the
  # String and the pointer together (#new returns both) and drop them
  # together. Nothing may keep the String, or a substring sharing its
  # buffer, past that.
  module BoundedString
    NEW_STATIC = Fiddle::Function.new(Fiddle::Handle::DEFAULT["rb_str_new_static"],
                                      [Fiddle::TYPE_VOIDP, Fiddle::TYPE_LONG], Fiddle::TYPE_UINTPTR_T)

    module_function

    # @param bytes [String]
    # @return [Array(String, Fiddle::Pointer)] a binary String of `bytes`,
    #   and the block that holds them.
    def new(bytes)
      size = bytes.bytesize
      block = Fiddle::Pointer.malloc([size, 1].max, Fiddle::RUBY_FREE)
      block[0, size] = bytes if size.positive?
      # The new String is referenced by nothing but an Integer until
      # dlunwrap makes it an object again: no GC in between.
      disabled = GC.disable
      string = Fiddle.dlunwrap(NEW_STATIC.call(block, size))
      GC.enable unless disabled
      [string, block]
    end
  end
end
