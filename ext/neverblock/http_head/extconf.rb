# frozen_string_literal: true

# Builds neverblock/http_head (NeverBlock::HTTPHead, see http_head.c): plain
# C99 against Ruby's own API (3.0+ for rb_enc_interned_str), so it builds
# wherever the gem installs. Without it (a `path:` gem, which Bundler does
# not compile) NeverBlock::Server parses every request with llhttp's Ruby
# callbacks, as before (see lib/neverblock/server/parser.rb).
require "mkmf"

$CFLAGS << " -std=c99 -Wall -O2"
create_makefile("neverblock/http_head")
