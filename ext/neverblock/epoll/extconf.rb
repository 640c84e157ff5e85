# frozen_string_literal: true

# Builds neverblock/epoll (NeverBlock::Epoll, see epoll.c) on Linux, where
# sys/epoll.h is. Elsewhere it writes a Makefile that builds nothing, so the
# gem still installs: NeverBlock::Server then holds each idle keep-alive
# connection in a fiber of its own, as before (see
# lib/neverblock/server/idle_set.rb).
require "mkmf"

if RUBY_PLATFORM.include?("linux") && have_header("sys/epoll.h") && have_func("epoll_create1", "sys/epoll.h")
  $CFLAGS << " -std=c99 -Wall -O2"
  create_makefile("neverblock/epoll")
else
  File.write("Makefile", <<~MAKE)
    all install static install-so install-rb clean distclean:
    \t@:
    .PHONY: all install static install-so install-rb clean distclean
  MAKE
end
