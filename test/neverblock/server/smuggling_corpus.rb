# frozen_string_literal: true

# Ambiguous HTTP/1.1 requests, each a named case with its raw bytes, after
# PortSwigger's request-smuggling research (CL.TE, TE.CL, TE.TE) and HTTP
# Garden's corpus (bare CR and LF, chunk framing, whitespace, overflow).
# test/neverblock/server/differential_test.rb sends every case to
# NeverBlock::Server directly and through nginx and HAProxy;
# bench/smuggling.rb sends them to NeverBlock and Puma the same way.
#
# Every case carries a second request, `GET /smuggled-<name>`
# ({SmugglingCorpus.smuggled}), placed so that a server that frames the
# case wrongly serves it: after the case's bytes, or inside a body that
# only a misreading ends early. The case's own request targets `/<name>`.
# A server that refuses the case, or reads it strictly by RFC 9112 (without
# its "MAY" leniencies: a bare LF as a line end, a bare CR or NUL as a space,
# obs-fold joined, duplicate Content-Lengths merged, and closing the
# connection after a request with both Content-Length and Transfer-Encoding
# or an HTTP/1.0 one with Transfer-Encoding), never serves a `/smuggled-` path.
#
# Control cases (category "control") are valid: `expected` lists what a
# server must serve of them, whole, ending with a pipelined `GET /next?<name>`.
module SmugglingCorpus
  # name: the case's slug (in its targets); category: see CATEGORIES;
  # bytes: what a client sends; expected: nil, or for a control case every
  # request to serve as [method, target, body bytes].
  Case = Struct.new(:name, :category, :bytes, :expected, keyword_init: true) do
    def control? = !expected.nil?
  end

  # Bytes of every smuggled request (0x80): a literal chunk size or
  # Content-Length in a case can then hide exactly one.
  SMUGGLED_BYTES = 128

  # Where a case's smuggled request goes in its template.
  SMUGGLED = "{smuggled}"

  # `GET /smuggled-<name>`, padded to {SMUGGLED_BYTES}.
  # @return [String]
  def self.smuggled(name)
    request = "GET /smuggled-#{name} HTTP/1.1\r\nHost: a\r\nX-Pad: \r\n\r\n"
    request.sub("X-Pad: ", "X-Pad: #{'p' * (SMUGGLED_BYTES - request.bytesize)}")
  end

  # The case a request target belongs to: `/<name>...`, `/smuggled-<name>`
  # or `/next?<name>`.
  # @return [String, nil] nil for a target no case sends
  def self.case_named_by(target)
    name = target.start_with?("/next?") ? target.delete_prefix("/next?") : target[%r{\A/(?:smuggled-)?([a-z0-9-]+)}, 1]
    name if NAMES.include?(name)
  end

  # @return [Boolean] whether `target` is a case's smuggled request.
  def self.smuggled?(target) = target.start_with?("/smuggled-")

  # The ways to write Transfer-Encoding: chunked that parsers have read
  # differently. Each is sent in three framings (see TE_FRAMINGS); the
  # variants that are no Transfer-Encoding at all by RFC 9112 only where a
  # strict reading still serves no smuggled request.
  TE_VARIANTS = {
    "xchunked" => "Transfer-Encoding: xchunked",
    "space-before-colon" => "Transfer-Encoding : chunked",
    "leading-space" => "Transfer-Encoding:  chunked",
    "trailing-space" => "Transfer-Encoding: chunked ",
    "tab" => "Transfer-Encoding:\tchunked",
    "vertical-tab" => "Transfer-Encoding:\vchunked",
    "twice" => "Transfer-Encoding: chunked\r\nTransfer-Encoding: x",
    "chunked-twice" => "Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked",
    "identity-chunked" => "Transfer-Encoding: identity, chunked",
    "gzip-chunked" => "Transfer-Encoding: gzip, chunked",
    "tab-after" => "Transfer-Encoding: chunked\t",
    "chunked-identity" => "Transfer-Encoding: chunked, identity",
    "upper-value" => "Transfer-Encoding: CHUNKED",
    "upper-name" => "TRANSFER-ENCODING: chunked",
    "obs-fold" => "Transfer-Encoding:\r\n chunked",
    "folded-into-host" => " Transfer-Encoding: chunked", # follows Host: a continuation of it
    "leading-comma" => "Transfer-Encoding: ,chunked",
    "quoted" => "Transfer-Encoding: \"chunked\"",
    "nul" => "Transfer-Encoding: chunked\x00",
    "empty" => "Transfer-Encoding:",
    "underscore" => "Transfer_Encoding: chunked" # not Transfer-Encoding: only CL.TE hides the smuggled request
  }.freeze

  # Each framing puts the variant `%s` after Host. CL.TE: Content-Length
  # covers the smuggled request, so a server that takes the variant for
  # chunked (and keeps the connection) serves it. TE.CL: the chunk holds it
  # and Content-Length covers only the chunk size, so a server that ignores
  # the variant and takes Content-Length serves it. TE.TE: the variant
  # alone, so a server that reads no body serves it, while the chunked
  # reading stops at the size line "GET ...".
  TE_FRAMINGS = {
    "CL.TE" => "%s\r\nContent-Length: 133\r\n\r\n0\r\n\r\n#{SMUGGLED}",
    "TE.CL" => "%s\r\nContent-Length: 4\r\n\r\n80\r\n#{SMUGGLED}\r\n0\r\n\r\n",
    "TE.TE" => "%s\r\n\r\n#{SMUGGLED}"
  }.freeze

  CHUNKED = "Transfer-Encoding: chunked\r\n\r\n"
  LONG = "a" * 5000
  HUGE = "a" * 70_000 # over NeverBlock's 64 KiB of headers and HAProxy's 16 KiB buffer

  # [name, category, bytes] with "{smuggled}" where the smuggled request
  # goes; a control case's expected requests follow.
  TEMPLATES = [
    # --- Content-Length and Transfer-Encoding together ------------------------
    ["cl-te", "CL.TE", "POST /cl-te HTTP/1.1\r\nHost: a\r\nContent-Length: 133\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n{smuggled}"],
    ["te-cl", "TE.CL", "POST /te-cl HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 4\r\n\r\n80\r\n{smuggled}\r\n0\r\n\r\n"],
    *TE_VARIANTS.flat_map do |variant, header|
      TE_FRAMINGS.filter_map do |framing, rest|
        next if variant == "underscore" && framing != "CL.TE"

        name = "#{variant}-#{framing.downcase.tr('.', '-')}"
        [name, framing, "POST /#{name} HTTP/1.1\r\nHost: a\r\n#{format(rest, header)}"]
      end
    end,

    # --- chunk sizes: 1 to 16 hex digits, nothing else --------------------------
    ["size-overflow", "chunk size", "POST /size-overflow HTTP/1.1\r\nHost: a\r\n#{CHUNKED}10000000000000005\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["size-17-digits", "chunk size", "POST /size-17-digits HTTP/1.1\r\nHost: a\r\n#{CHUNKED}00000000000000080\r\n{smuggled}\r\n0\r\n\r\n"],
    ["size-leading-zeros", "chunk size", "POST /size-leading-zeros HTTP/1.1\r\nHost: a\r\n#{CHUNKED}0080\r\n{smuggled}\r\n0\r\n\r\n"],
    ["size-uppercase", "chunk size", "POST /size-uppercase HTTP/1.1\r\nHost: a\r\n#{CHUNKED}8A\r\n{smuggled}0123456789\r\n0\r\n\r\n"],
    ["size-0x", "chunk size", "POST /size-0x HTTP/1.1\r\nHost: a\r\n#{CHUNKED}0x5\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["size-negative", "chunk size", "POST /size-negative HTTP/1.1\r\nHost: a\r\n#{CHUNKED}-5\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["size-plus", "chunk size", "POST /size-plus HTTP/1.1\r\nHost: a\r\n#{CHUNKED}+5\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["size-space-before", "chunk size", "POST /size-space-before HTTP/1.1\r\nHost: a\r\n#{CHUNKED} 5\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["size-space-after", "chunk size", "POST /size-space-after HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5 \r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["size-not-hex", "chunk size", "POST /size-not-hex HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5g\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["size-underscore", "chunk size", "POST /size-underscore HTTP/1.1\r\nHost: a\r\n#{CHUNKED}0_5\r\nhello\r\n0\r\n\r\n{smuggled}"],

    # --- chunk extensions and trailers ----------------------------------------
    ["ext-valid", "chunk extension", "POST /ext-valid HTTP/1.1\r\nHost: a\r\n#{CHUNKED}80;name=value;flag\r\n{smuggled}\r\n0\r\n\r\n"],
    ["ext-quoted", "chunk extension", "POST /ext-quoted HTTP/1.1\r\nHost: a\r\n#{CHUNKED}80;a=\"b;c\\\"d\"\r\n{smuggled}\r\n0\r\n\r\n"],
    ["ext-empty", "chunk extension", "POST /ext-empty HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5;\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["ext-no-name", "chunk extension", "POST /ext-no-name HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5;=x\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["ext-open-quote", "chunk extension", "POST /ext-open-quote HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5;a=\"open\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["ext-bare-cr", "chunk extension", "POST /ext-bare-cr HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5;a\rb\r\nhello\r\n0\r\n\r\n{smuggled}"],
    # "Funky chunks": a reader that ends the size line at the bare LF takes
    # "xx" as the data and hides the smuggled request in the 0x85 chunk; one
    # that skips the extension up to CRLF takes "85" as the data, then the
    # last chunk, and serves it.
    ["ext-bare-lf", "chunk extension", "POST /ext-bare-lf HTTP/1.1\r\nHost: a\r\n#{CHUNKED}2;\nxx\r\n85\r\n0\r\n\r\n{smuggled}\r\n0\r\n\r\n"],
    ["trailer-valid", "trailer", "POST /trailer-valid HTTP/1.1\r\nHost: a\r\n#{CHUNKED}80\r\n{smuggled}\r\n0\r\nX-Trailer: v\r\n\r\n"],
    ["trailer-space-before-colon", "trailer", "POST /trailer-space-before-colon HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n0\r\nX-Trailer : v\r\n\r\n{smuggled}"],
    ["trailer-no-colon", "trailer", "POST /trailer-no-colon HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n0\r\nX-Trailer\r\n\r\n{smuggled}"],
    ["trailer-obs-fold", "trailer", "POST /trailer-obs-fold HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n0\r\nX-Trailer: v\r\n folded\r\n\r\n{smuggled}"],
    # No empty line after the last chunk: the smuggled request's lines are trailers.
    ["trailer-missing-end", "trailer", "POST /trailer-missing-end HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n0\r\n{smuggled}"],

    # --- chunk data not followed by CRLF (llhttp 8.1 skipped those two bytes) -----
    ["chunk-data-xx", "chunk data", "POST /chunk-data-xx HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhelloXX0\r\n\r\n{smuggled}"],
    ["chunk-data-cr-x", "chunk data", "POST /chunk-data-cr-x HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\rX0\r\n\r\n{smuggled}"],
    ["chunk-data-lf", "chunk data", "POST /chunk-data-lf HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\n0\r\n\r\n{smuggled}"],
    ["chunk-data-no-crlf", "chunk data", "POST /chunk-data-no-crlf HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello0\r\n\r\n{smuggled}"],
    ["chunk-data-longer", "chunk data", "POST /chunk-data-longer HTTP/1.1\r\nHost: a\r\n#{CHUNKED}3\r\nhello\r\n0\r\n\r\n{smuggled}"],
    ["chunk-data-shorter", "chunk data", "POST /chunk-data-shorter HTTP/1.1\r\nHost: a\r\n#{CHUNKED}7\r\nhello\r\n0\r\n\r\n{smuggled}"],

    # --- bare CR and bare LF --------------------------------------------------------
    ["lf-request-line", "bare CR/LF", "GET /lf-request-line HTTP/1.1\nHost: a\r\n\r\n{smuggled}"],
    ["cr-request-line", "bare CR/LF", "GET /cr-request-line HTTP/1.1\rHost: a\r\n\r\n{smuggled}"],
    ["cr-in-target", "bare CR/LF", "GET /cr-in-target\r/x HTTP/1.1\r\nHost: a\r\n\r\n{smuggled}"],
    # A bare LF as a line end makes the next line a Content-Length that
    # hides the smuggled request; as part of X's value, there is no body.
    ["lf-header-line", "bare CR/LF", "POST /lf-header-line HTTP/1.1\r\nHost: a\r\nX: y\nContent-Length: 128\r\n\r\n{smuggled}"],
    # A bare CR as a space keeps Content-Length: 128; as a line end, a second
    # Content-Length: 0 that a last-one-wins reader takes.
    ["cr-header-line", "bare CR/LF", "POST /cr-header-line HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\nX: y\rContent-Length: 0\r\n\r\n{smuggled}"],
    ["lf-head-end", "bare CR/LF", "GET /lf-head-end HTTP/1.1\r\nHost: a\r\n\n{smuggled}"],
    ["lf-lf-head-end", "bare CR/LF", "GET /lf-lf-head-end HTTP/1.1\nHost: a\n\n{smuggled}"],
    ["lf-crlf-head-end", "bare CR/LF", "GET /lf-crlf-head-end HTTP/1.1\r\nHost: a\n\r\n{smuggled}"],
    ["cr-x-head-end", "bare CR/LF", "GET /cr-x-head-end HTTP/1.1\r\nHost: a\r\n\rX{smuggled}"],
    ["cr-x-head-end-body", "bare CR/LF", "POST /cr-x-head-end-body HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\rXhello{smuggled}"],
    ["lf-chunk-size", "bare CR/LF", "POST /lf-chunk-size HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\nhello\r\n0\r\n\r\n{smuggled}"],
    ["cr-chunk-size", "bare CR/LF", "POST /cr-chunk-size HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\rhello\r\n0\r\n\r\n{smuggled}"],
    ["lf-last-chunk", "bare CR/LF", "POST /lf-last-chunk HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n0\n\r\n{smuggled}"],
    ["lf-body-end", "bare CR/LF", "POST /lf-body-end HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n0\r\n\n{smuggled}"],
    ["lf-trailer", "bare CR/LF", "POST /lf-trailer HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n0\r\nX-Trailer: v\n\r\n{smuggled}"],

    # --- Content-Length: 1*DIGIT, once ------------------------------------------
    ["cl-twice", "Content-Length", "POST /cl-twice HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["cl-first-zero", "Content-Length", "POST /cl-first-zero HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["cl-last-zero", "Content-Length", "POST /cl-last-zero HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\nContent-Length: 0\r\n\r\n{smuggled}"],
    ["cl-list", "Content-Length", "POST /cl-list HTTP/1.1\r\nHost: a\r\nContent-Length: 128, 128\r\n\r\n{smuggled}"],
    ["cl-list-zero", "Content-Length", "POST /cl-list-zero HTTP/1.1\r\nHost: a\r\nContent-Length: 0, 128\r\n\r\n{smuggled}"],
    ["cl-empty", "Content-Length", "POST /cl-empty HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n\r\n{smuggled}"],
    ["cl-plus", "Content-Length", "POST /cl-plus HTTP/1.1\r\nHost: a\r\nContent-Length: +128\r\n\r\n{smuggled}"],
    ["cl-hex", "Content-Length", "POST /cl-hex HTTP/1.1\r\nHost: a\r\nContent-Length: 0x80\r\n\r\n{smuggled}"],
    ["cl-negative", "Content-Length", "POST /cl-negative HTTP/1.1\r\nHost: a\r\nContent-Length: -128\r\n\r\n{smuggled}"],
    ["cl-overflow", "Content-Length", "POST /cl-overflow HTTP/1.1\r\nHost: a\r\nContent-Length: 18446744073709551616\r\n\r\n{smuggled}"], # 2**64
    ["cl-leading-zeros", "Content-Length", "POST /cl-leading-zeros HTTP/1.1\r\nHost: a\r\nContent-Length: 000128\r\n\r\n{smuggled}"],
    ["cl-tabs", "Content-Length", "POST /cl-tabs HTTP/1.1\r\nHost: a\r\nContent-Length:\t128\t\r\n\r\n{smuggled}"],
    ["cl-trailing-tab", "Content-Length", "POST /cl-trailing-tab HTTP/1.1\r\nHost: a\r\nContent-Length: 128\t\r\n\r\n{smuggled}"],
    ["cl-trailing-blanks", "Content-Length", "POST /cl-trailing-blanks HTTP/1.1\r\nHost: a\r\nContent-Length: 128 \t \r\n\r\n{smuggled}"],
    ["cl-vertical-tab", "Content-Length", "POST /cl-vertical-tab HTTP/1.1\r\nHost: a\r\nContent-Length:\v128\r\n\r\n{smuggled}"],
    ["cl-space-before-colon", "Content-Length", "POST /cl-space-before-colon HTTP/1.1\r\nHost: a\r\nContent-Length : 128\r\n\r\n{smuggled}"],
    ["cl-obs-fold", "Content-Length", "POST /cl-obs-fold HTTP/1.1\r\nHost: a\r\nContent-Length:\r\n 128\r\n\r\n{smuggled}"],

    # --- other header lines: duplicates, empty names and values, whitespace ---------
    ["host-twice", "headers", "GET /host-twice HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n{smuggled}"],
    ["host-missing", "headers", "GET /host-missing HTTP/1.1\r\n\r\n{smuggled}"],
    ["host-empty", "headers", "POST /host-empty HTTP/1.1\r\nHost:\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["host-space-before-colon", "headers", "GET /host-space-before-colon HTTP/1.1\r\nHost : a\r\n\r\n{smuggled}"],
    ["empty-header-name", "headers", "GET /empty-header-name HTTP/1.1\r\nHost: a\r\n: x\r\n\r\n{smuggled}"],
    ["header-no-colon", "headers", "GET /header-no-colon HTTP/1.1\r\nHost: a\r\nX-Header\r\n\r\n{smuggled}"],
    ["space-in-header-name", "headers", "GET /space-in-header-name HTTP/1.1\r\nHost: a\r\nX Header: v\r\n\r\n{smuggled}"],
    ["tab-before-colon", "headers", "GET /tab-before-colon HTTP/1.1\r\nHost: a\r\nX-Header\t: v\r\n\r\n{smuggled}"],
    ["space-before-first-header", "headers", "GET /space-before-first-header HTTP/1.1\r\n Host: a\r\n\r\n{smuggled}"],
    ["obs-fold", "headers", "GET /obs-fold HTTP/1.1\r\nHost: a\r\nX-Header: v\r\n folded\r\n\r\n{smuggled}"],
    ["obs-fold-empty-value", "headers", "GET /obs-fold-empty-value HTTP/1.1\r\nHost: a\r\nX-Header:\r\n folded\r\n\r\n{smuggled}"],
    ["nul-in-value", "headers", "GET /nul-in-value HTTP/1.1\r\nHost: a\r\nX-Header: a\x00b\r\n\r\n{smuggled}"],
    ["double-space", "request line", "GET  /double-space HTTP/1.1\r\nHost: a\r\n\r\n{smuggled}"],
    ["tab-separators", "request line", "GET\t/tab-separators\tHTTP/1.1\r\nHost: a\r\n\r\n{smuggled}"],
    ["space-after-version", "request line", "GET /space-after-version HTTP/1.1 \r\nHost: a\r\n\r\n{smuggled}"],
    ["lowercase-version", "request line", "GET /lowercase-version http/1.1\r\nHost: a\r\n\r\n{smuggled}"],
    # HTAB and FF are no part of a request-target (RFC 9112 3.2); llhttp 8.1
    # took both in one, so a reader that splits the line at the HTAB saw
    # another target and version.
    ["tab-in-target", "request line", "GET /tab-in-target\tHTTP/1.1 HTTP/1.1\r\nHost: a\r\n\r\n{smuggled}"],
    ["ff-in-target", "request line", "GET /ff-in-target\fb HTTP/1.1\r\nHost: a\r\n\r\n{smuggled}"],
    ["vertical-tab-in-target", "request line", "GET /vertical-tab-in-target\vb HTTP/1.1\r\nHost: a\r\n\r\n{smuggled}"],

    # --- empty lines before the request line (RFC 9112 2.2) -----------------------------
    # The smuggled request is the body: served by no server, whatever it makes of the lines.
    ["empty-lines-few", "empty lines", "\r\n\r\nPOST /empty-lines-few HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["empty-lines-many", "empty lines", "#{"\r\n" * 8}POST /empty-lines-many HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["empty-line-bare-lf", "empty lines", "\nPOST /empty-line-bare-lf HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["empty-line-bare-cr", "empty lines", "\r\r\nPOST /empty-line-bare-cr HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\n\r\n{smuggled}"],

    # --- overlong lines: whoever refuses them must refuse the whole message ------------
    ["long-request-line", "overlong", "POST /long-request-line?#{'a' * 9000} HTTP/1.1\r\nHost: a\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["long-header", "overlong", "POST /long-header HTTP/1.1\r\nHost: a\r\nX-Long: #{'a' * 9000}\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["huge-header", "overlong", "POST /huge-header HTTP/1.1\r\nHost: a\r\nX-Long: #{HUGE}\r\nContent-Length: 128\r\n\r\n{smuggled}"],
    ["many-headers", "overlong", "POST /many-headers HTTP/1.1\r\nHost: a\r\n#{Array.new(200) { |i| "X-#{i}: v\r\n" }.join}Content-Length: 128\r\n\r\n{smuggled}"],
    ["long-chunk-size", "overlong", "POST /long-chunk-size HTTP/1.1\r\nHost: a\r\n#{CHUNKED}#{'0' * 5000}80\r\n{smuggled}\r\n0\r\n\r\n"],
    ["long-chunk-ext", "overlong", "POST /long-chunk-ext HTTP/1.1\r\nHost: a\r\n#{CHUNKED}80;#{LONG}\r\n{smuggled}\r\n0\r\n\r\n"],
    ["huge-trailer", "overlong", "POST /huge-trailer HTTP/1.1\r\nHost: a\r\n#{CHUNKED}80\r\n{smuggled}\r\n0\r\nX-Trailer: #{HUGE}\r\n\r\n"],

    # --- HTTP/1.0 with Transfer-Encoding: faulty framing, the connection must close ------
    ["http10-te", "HTTP/1.0", "POST /http10-te HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n#{CHUNKED}0\r\n\r\n{smuggled}"],
    ["http10-te-close", "HTTP/1.0", "POST /http10-te-close HTTP/1.0\r\nHost: a\r\n#{CHUNKED}0\r\n\r\n{smuggled}"],
    ["http10-cl-te", "HTTP/1.0", "POST /http10-cl-te HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\nContent-Length: 133\r\n#{CHUNKED}0\r\n\r\n{smuggled}"],
    ["http10-te-cl", "HTTP/1.0", "POST /http10-te-cl HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\nContent-Length: 4\r\n#{CHUNKED}80\r\n{smuggled}\r\n0\r\n\r\n"],

    # --- valid requests, which every server must serve whole ---------------------------
    ["control-chunked", "control",
     "POST /control-chunked HTTP/1.1\r\nHost: a\r\n#{CHUNKED}5\r\nhello\r\n6;ext=1\r\n world\r\n0\r\nX-Trailer: 1\r\n\r\n" \
     "GET /next?control-chunked HTTP/1.1\r\nHost: a\r\n\r\n",
     [["POST", "/control-chunked", 11], ["GET", "/next?control-chunked", 0]]],
    ["control-chunked-large", "control",
     "POST /control-chunked-large HTTP/1.1\r\nHost: a\r\n#{CHUNKED}400\r\n#{'b' * 1024}\r\n0\r\n\r\n" \
     "GET /next?control-chunked-large HTTP/1.1\r\nHost: a\r\n\r\n",
     [["POST", "/control-chunked-large", 1024], ["GET", "/next?control-chunked-large", 0]]],
    ["control-content-length", "control",
     "POST /control-content-length HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello" \
     "GET /next?control-content-length HTTP/1.1\r\nHost: a\r\n\r\n",
     [["POST", "/control-content-length", 5], ["GET", "/next?control-content-length", 0]]],
    ["control-empty-lines", "control",
     "\r\nGET /control-empty-lines HTTP/1.1\r\nHost: a\r\n\r\n\r\n\r\nGET /next?control-empty-lines HTTP/1.1\r\nHost: a\r\n\r\n",
     [["GET", "/control-empty-lines", 0], ["GET", "/next?control-empty-lines", 0]]],
    ["control-get", "control",
     "GET /control-get HTTP/1.1\r\nHost: a\r\n\r\nGET /next?control-get HTTP/1.1\r\nHost: a\r\n\r\n",
     [["GET", "/control-get", 0], ["GET", "/next?control-get", 0]]]
  ].freeze

  # Every case, in the order above.
  CASES = TEMPLATES.map do |name, category, template, expected|
    Case.new(name: name, category: category, bytes: template.sub(SMUGGLED, smuggled(name)).b.freeze, expected: expected&.freeze).freeze
  end.freeze

  NAMES = CASES.map(&:name).freeze

  # The categories, in order.
  CATEGORIES = CASES.map(&:category).uniq.freeze

  private_constant :SMUGGLED, :TE_FRAMINGS, :TEMPLATES, :CHUNKED, :LONG, :HUGE
end
