// NeverBlock::HTTPHead: the server's fast path from a request head to its
// Rack env (NeverBlock::Server::Parser, lib/neverblock/server/parser.rb).
//
// llhttp parses every request; the env is built in Ruby callbacks, which
// cost a keep-alive hello-world request about a fifth of its CPU
// (docs/benchmarks.md, "Hello-world profile"). #parse builds the same env
// in C, but only for the plain, complete head that llhttp (as the server
// runs it) accepts with the same meaning, and "declines" (returns nil)
// everything else: an incomplete head, a byte outside the sets below, a
// method other than the seven common ones, Transfer-Encoding, Upgrade,
// Expect, Proxy-Connection, a Connection header other than a lone
// `keep-alive` or `close`, an HTTP/1.1 request without Host, a header
// repeated, a Content-Length that
// is not digits only or over max_body, a Host that is not a plain
// `name[:port]`, anything over a Limit. The Parser hands what it declines
// to llhttp exactly as before, so every refusal, its status and its message
// stay llhttp's or the Parser's; test/neverblock/server/head_parser_test.rb
// checks, byte by byte and on the fuzz generator's cases, that whatever
// #parse accepts, the llhttp path yields the same env from.
//
// Written for NeverBlock from RFC 9110/9112 and the behaviour of the
// Ruby callbacks it stands in for (Parser#store_header, #http_key,
// #build_request, #set_target, #set_host): no parser code is taken from
// elsewhere.
#include <ruby.h>
#include <ruby/encoding.h>
#include <string.h>

// HTTPHead.response_headers (response_head.c), called once the byte classes are filled.
void nb_response_head_init(VALUE klass);

// The common methods (llhttp knows them all); anything else is declined.
enum { METHOD_OTHER, METHOD_GET, METHOD_HEAD, METHOD_POST, METHOD_PUT, METHOD_DELETE, METHOD_OPTIONS, METHOD_PATCH };

// Bytes of a header name that fit the key buffer ("HTTP_" + name); a
// longer name is declined (llhttp takes it).
#define NAME_MAX_BYTES 250

// Content-Length digits: 18 cannot overflow a long; more is declined.
#define LENGTH_MAX_DIGITS 18

// Byte classes: a target byte (origin-form, no CTL, SP or DEL: llhttp also
// takes HTAB and FF, which are declined), a token byte (RFC 9110 tchar: a
// header name; shared with response_head.c) and a field value byte (VCHAR,
// SP, HTAB, obs-text).
static unsigned char target_byte[256], value_byte[256], host_byte[256];
unsigned char nb_token_byte[256];

static VALUE key_request_method, key_server_protocol, key_path_info, key_query_string;
static VALUE key_server_name, key_server_port, key_early_hints;
static VALUE protocol11, protocol10, empty_query, default_port80;
// REQUEST_METHOD's values, by METHOD_*: frozen, interned, binary (as llhttp's
// method_name, interned by the Ruby path): one String per method, not one
// per request.
static VALUE method_names[METHOD_PATCH + 1];

typedef struct {
    VALUE base_env;     // the connection's env entries, duplicated for each request
    VALUE default_host; // SERVER_NAME and SERVER_PORT of an HTTP/1.0 request without Host
    VALUE default_port;
    VALUE host;         // the last Host checked (binary, frozen) and its parts; Qnil until one
    VALUE server_name;
    VALUE server_port;
    long max_target, max_header_bytes, max_headers, max_body;
    long head_end;       // the last parsed head's end: offset of its body in the data
    long content_length; // its Content-Length (0 without one)
    int head;            // its method was HEAD
    int http10;          // it was HTTP/1.0
    int keep_alive;      // its connection stays open after it (llhttp's keep_alive?)
} nb_head_t;

static void nb_head_mark(void *data) {
    nb_head_t *head = data;
    rb_gc_mark(head->base_env);
    rb_gc_mark(head->default_host);
    rb_gc_mark(head->default_port);
    rb_gc_mark(head->host);
    rb_gc_mark(head->server_name);
    rb_gc_mark(head->server_port);
}

static size_t nb_head_memsize(const void *data) {
    return sizeof(nb_head_t);
}

// Write-barrier protected: every store of a VALUE into the struct after
// allocation goes through RB_OBJ_WRITE, so an old HTTPHead (one per open
// connection) is not marked again on every minor GC.
static const rb_data_type_t nb_head_type = {
    "NeverBlock::HTTPHead",
    {nb_head_mark, RUBY_TYPED_DEFAULT_FREE, nb_head_memsize},
    0, 0, RUBY_TYPED_FREE_IMMEDIATELY | RUBY_TYPED_WB_PROTECTED
};

static VALUE nb_head_alloc(VALUE klass) {
    nb_head_t *head;
    VALUE self = TypedData_Make_Struct(klass, nb_head_t, &nb_head_type, head);
    head->base_env = head->default_host = head->default_port = Qnil;
    head->host = head->server_name = head->server_port = Qnil;
    return self;
}

static nb_head_t *nb_head_get(VALUE self) {
    nb_head_t *head;
    TypedData_Get_Struct(self, nb_head_t, &nb_head_type, head);
    return head;
}

// HTTPHead.new(base_env, default_host, default_port, max_request_target,
// max_header_bytes, max_headers, max_body): one per connection, with its
// Parser's limits (bytes, and a count of header lines).
static VALUE nb_head_initialize(VALUE self, VALUE base_env, VALUE default_host, VALUE default_port,
                                VALUE max_target, VALUE max_header_bytes, VALUE max_headers, VALUE max_body) {
    nb_head_t *head = nb_head_get(self);
    Check_Type(base_env, T_HASH);
    StringValue(default_host);
    StringValue(default_port);
    RB_OBJ_WRITE(self, &head->base_env, base_env);
    RB_OBJ_WRITE(self, &head->default_host, default_host);
    RB_OBJ_WRITE(self, &head->default_port, default_port);
    head->max_target = NUM2LONG(max_target);
    head->max_header_bytes = NUM2LONG(max_header_bytes);
    head->max_headers = NUM2LONG(max_headers);
    head->max_body = NUM2LONG(max_body);
    return self;
}

static int method_of(const char *name, long length) {
    switch (length) {
    case 3:
        if (memcmp(name, "GET", 3) == 0) return METHOD_GET;
        if (memcmp(name, "PUT", 3) == 0) return METHOD_PUT;
        break;
    case 4:
        if (memcmp(name, "HEAD", 4) == 0) return METHOD_HEAD;
        if (memcmp(name, "POST", 4) == 0) return METHOD_POST;
        break;
    case 5:
        if (memcmp(name, "PATCH", 5) == 0) return METHOD_PATCH;
        break;
    case 6:
        if (memcmp(name, "DELETE", 6) == 0) return METHOD_DELETE;
        break;
    case 7:
        if (memcmp(name, "OPTIONS", 7) == 0) return METHOD_OPTIONS;
        break;
    }
    return METHOD_OTHER;
}

// Whether `name` is `lower` (lowercase ASCII), ignoring case.
static int name_is(const char *name, long length, const char *lower, long lower_length) {
    if (length != lower_length) return 0;
    for (long i = 0; i < length; i++) {
        char c = name[i];
        if (c >= 'A' && c <= 'Z') c += 'a' - 'A';
        if (c != lower[i]) return 0;
    }
    return 1;
}

#define NAME_IS(name, length, lower) name_is(name, length, lower, (long)sizeof(lower) - 1)

// The Rack key of a header name as Parser#http_key makes it (HTTP_ and the
// name upcased, `-` as `_`; CONTENT_TYPE and CONTENT_LENGTH without the
// prefix), interned: one frozen String per key, shared by every request.
static VALUE header_key(const char *name, long length) {
    char key[NAME_MAX_BYTES + 5];
    memcpy(key, "HTTP_", 5);
    for (long i = 0; i < length; i++) {
        char c = name[i];
        if (c >= 'a' && c <= 'z') c -= 'a' - 'A';
        else if (c == '-') c = '_';
        key[5 + i] = c;
    }
    long start = 0;
    if ((length == 12 && memcmp(key + 5, "CONTENT_TYPE", 12) == 0) ||
        (length == 14 && memcmp(key + 5, "CONTENT_LENGTH", 14) == 0)) {
        start = 5;
    }
    return rb_enc_interned_str(key + start, length + 5 - start, rb_utf8_encoding());
}

// A Host as Parser#plain_host? accepts it: `name` of letters, digits, `.`
// and `-` (not empty), then maybe `:` and digits (maybe none). Sets the
// head's cached host, server_name and server_port. Other Hosts (IPv6
// literals, %-escapes, ...) are checked by the Ruby path: returns 0.
static int check_host(VALUE self, nb_head_t *head, const char *host, long length) {
    long colon = -1;
    for (long i = 0; i < length; i++) {
        unsigned char c = (unsigned char)host[i];
        if (host_byte[c]) continue;
        if (c != ':' || colon >= 0) return 0;
        colon = i;
    }
    if (length == 0 || colon == 0) return 0;
    if (colon > 0) {
        for (long i = colon + 1; i < length; i++) {
            if (host[i] < '0' || host[i] > '9') return 0;
        }
    }
    rb_encoding *binary = rb_ascii8bit_encoding();
    long name_length = colon < 0 ? length : colon;
    long port_length = colon < 0 ? 0 : length - colon - 1;
    RB_OBJ_WRITE(self, &head->host, rb_enc_interned_str(host, length, binary));
    RB_OBJ_WRITE(self, &head->server_name, rb_enc_interned_str(host, name_length, binary));
    RB_OBJ_WRITE(self, &head->server_port,
                 port_length == 0 ? default_port80 : rb_enc_interned_str(host + colon + 1, port_length, binary));
    return 1;
}

// PATH_INFO and QUERY_STRING as Parser#set_target splits an origin-form
// target (a `/...` one): the path up to `?` and `#`, the query after `?`
// up to `#`.
static void set_target(VALUE env, const char *target, long length) {
    const char *question = memchr(target, '?', length);
    const char *hash = memchr(target, '#', length);
    if (!question && !hash) {
        rb_hash_aset(env, key_path_info, rb_str_new(target, length));
        rb_hash_aset(env, key_query_string, empty_query);
        return;
    }
    long path_length = question ? question - target : length;
    const char *path_hash = memchr(target, '#', path_length);
    rb_hash_aset(env, key_path_info, rb_str_new(target, path_hash ? path_hash - target : path_length));
    VALUE query = empty_query; // no `?`, or nothing after it: the frozen "" (`query || ""`)
    if (question && question + 1 < target + length) {
        const char *start = question + 1;
        long query_length = target + length - start;
        const char *query_hash = memchr(start, '#', query_length);
        query = rb_str_new(start, query_hash ? query_hash - start : query_length);
    }
    rb_hash_aset(env, key_query_string, query);
}

// #parse(data, offset) -> Hash or nil: the env of the request whose head
// starts at byte `offset` of `data` (a message boundary: nothing of it went
// to llhttp), or nil when the fast path declines it (see the top of this
// file): hand `data` from `offset` to llhttp then. After an env,
// #head_end, #content_length, #head?, #http10? and #keep_alive? describe
// the request. Kept alive, as llhttp says: HTTP/1.1 without `Connection:
// close`, HTTP/1.0 with `Connection: keep-alive`. A request not kept alive
// (a proxy's `Connection: close`, nginx's default to its upstreams) takes
// the fast path too. Nothing of `data` is kept.
static VALUE nb_head_parse(VALUE self, VALUE data, VALUE offset_value) {
    nb_head_t *head = nb_head_get(self);
    StringValue(data);
    long offset = NUM2LONG(offset_value);
    long size = RSTRING_LEN(data);
    if (offset < 0 || offset > size) rb_raise(rb_eArgError, "offset %ld outside the data (%ld bytes)", offset, size);

    const char *start = RSTRING_PTR(data);
    const char *p = start + offset;
    const char *end = start + size;
    // Most declined heads are incomplete ones: found before anything is built.
    if (end - p < 4) return Qnil;
    const char *last = end - 3;
    const char *scan = p;
    for (;;) {
        scan = memchr(scan, '\r', last - scan);
        if (!scan) return Qnil;
        if (scan[1] == '\n' && scan[2] == '\r' && scan[3] == '\n') break;
        scan++;
    }
    end = scan + 4; // the head's end: what follows is the body or the next request

    // Request line: method SP origin-form SP HTTP/1.x CRLF.
    const char *method = p;
    while (p < end && *p >= 'A' && *p <= 'Z') p++;
    int method_id = method_of(method, p - method);
    if (method_id == METHOD_OTHER || *p != ' ') return Qnil;
    p++;
    const char *target = p;
    if (*p != '/') return Qnil;
    while (target_byte[(unsigned char)*p]) p++; // stops at the head's CR at the latest
    long target_length = p - target;
    if (*p != ' ' || target_length > head->max_target) return Qnil;
    p++;
    if (end - p < 10 || memcmp(p, "HTTP/1.", 7) != 0 || (p[7] != '0' && p[7] != '1') || p[8] != '\r' || p[9] != '\n') {
        return Qnil;
    }
    int is_http10 = p[7] == '0';
    p += 10;

    VALUE env = rb_hash_dup(head->base_env);
    long count = 0;
    long header_bytes = 0;
    const char *block = p;
    const char *host = NULL;
    long host_length = 0;
    int keep_alive_header = 0;
    int close_header = 0;
    long content_length = -1;
    // Header lines: token `:` OWS value OWS CRLF, to the empty line.
    while (p[0] != '\r') {
        const char *name = p;
        while (nb_token_byte[(unsigned char)*p]) p++;
        long name_length = p - name;
        // Not a token then `:`: `Host : x`, an obs-fold line (SP first), a bare LF...
        if (name_length == 0 || name_length > NAME_MAX_BYTES || *p != ':') return Qnil;
        p++;
        while (*p == ' ' || *p == '\t') p++;
        const char *value = p;
        while (value_byte[(unsigned char)*p]) p++;
        if (p[0] != '\r' || p[1] != '\n') return Qnil; // a bare CR or LF, a CTL, NUL
        const char *value_end = p;
        p += 2;
        // Both of the Parser's counts for max_header_bytes: the raw block so
        // far (every byte of every line, OWS included), and name and value
        // with 4 bytes each beside. Whitespace is bytes a client sent.
        header_bytes += name_length + (value_end - value) + 8;
        if (++count > head->max_headers || header_bytes > head->max_header_bytes ||
            p - block > head->max_header_bytes) {
            return Qnil;
        }
        long raw_length = value_end - value;
        while (value_end > value && (value_end[-1] == ' ' || value_end[-1] == '\t')) value_end--;
        long value_length = value_end - value;

        if (NAME_IS(name, name_length, "content-length")) {
            // Digits only, nothing after them (llhttp refuses `5\t`, takes `5 `:
            // both declined); an empty value is llhttp's to refuse.
            if (raw_length != value_length || value_length == 0 || value_length > LENGTH_MAX_DIGITS) return Qnil;
            long length = 0;
            for (long i = 0; i < value_length; i++) {
                if (value[i] < '0' || value[i] > '9') return Qnil;
                length = length * 10 + (value[i] - '0');
            }
            if (content_length >= 0 || length > head->max_body) return Qnil; // duplicate: llhttp refuses; 413
            content_length = length;
        } else if (NAME_IS(name, name_length, "connection")) {
            // Only a lone `keep-alive` or `close` (any case): `upgrade` and lists are llhttp's.
            if (raw_length != value_length) return Qnil;
            if (NAME_IS(value, value_length, "keep-alive")) keep_alive_header = 1;
            else if (NAME_IS(value, value_length, "close")) close_header = 1;
            else return Qnil;
        } else if (NAME_IS(name, name_length, "host")) {
            host = value;
            host_length = value_length;
        } else if (NAME_IS(name, name_length, "transfer-encoding") || NAME_IS(name, name_length, "upgrade") ||
                   NAME_IS(name, name_length, "expect") || NAME_IS(name, name_length, "proxy-connection")) {
            return Qnil;
        }
        // A name with `_` could pose as one with `-`: dropped, as Parser#http_key does.
        if (memchr(name, '_', name_length)) continue;

        long entries = (long)RHASH_SIZE(env);
        rb_hash_aset(env, header_key(name, name_length), rb_str_new(value, value_length));
        // A repeated header is joined by the Ruby path (", ", or "; " for Cookie): declined.
        if ((long)RHASH_SIZE(env) == entries) return Qnil;
    }
    // The empty line must be the CRLF found above: `\r` and another byte at a
    // line's start is no end of the head (llhttp 8.1 takes it; the Parser refuses it).
    if (p + 2 != end) return Qnil;
    // (Checked per line above; again here for a head without header lines,
    // HTTP/1.0's, against a limit below zero: none is under it.)
    if (count > head->max_headers || header_bytes > head->max_header_bytes) return Qnil;
    p += 2;
    if (!is_http10 && host == NULL) return Qnil; // 400 without Host (llhttp's, through the Parser)

    VALUE server_name, server_port;
    if (host == NULL) {
        server_name = head->default_host;
        server_port = head->default_port;
    } else if (RTEST(head->host) && RSTRING_LEN(head->host) == host_length &&
               memcmp(RSTRING_PTR(head->host), host, host_length) == 0) {
        server_name = head->server_name; // a connection's requests nearly always repeat their Host
        server_port = head->server_port;
    } else if (check_host(self, head, host, host_length)) {
        server_name = head->server_name;
        server_port = head->server_port;
    } else {
        return Qnil;
    }

    rb_hash_aset(env, key_request_method, method_names[method_id]);
    rb_hash_aset(env, key_server_protocol, is_http10 ? protocol10 : protocol11);
    if (is_http10) rb_hash_delete(env, key_early_hints); // 1xx responses are HTTP/1.1's
    set_target(env, target, target_length);
    rb_hash_aset(env, key_server_name, server_name);
    rb_hash_aset(env, key_server_port, server_port);

    head->head_end = p - start;
    head->content_length = content_length < 0 ? 0 : content_length;
    head->head = method_id == METHOD_HEAD;
    head->http10 = is_http10;
    head->keep_alive = is_http10 ? keep_alive_header : !close_header;
    RB_GC_GUARD(data);
    return env;
}

// #head_end: the offset in the data of the last parsed head's end.
static VALUE nb_head_head_end(VALUE self) {
    return LONG2NUM(nb_head_get(self)->head_end);
}

// #content_length: the last parsed request's Content-Length (0 without one).
static VALUE nb_head_content_length(VALUE self) {
    return LONG2NUM(nb_head_get(self)->content_length);
}

// #head?: whether the last parsed request was a HEAD request.
static VALUE nb_head_head_p(VALUE self) {
    return nb_head_get(self)->head ? Qtrue : Qfalse;
}

// #http10?: whether the last parsed request was HTTP/1.0.
static VALUE nb_head_http10_p(VALUE self) {
    return nb_head_get(self)->http10 ? Qtrue : Qfalse;
}

// #keep_alive?: whether the last parsed request's connection stays open
// after it.
static VALUE nb_head_keep_alive_p(VALUE self) {
    return nb_head_get(self)->keep_alive ? Qtrue : Qfalse;
}

// Sets *slot to the interned `text` (UTF-8, frozen), kept for the process's life.
static void intern(VALUE *slot, const char *text) {
    *slot = rb_enc_interned_str(text, (long)strlen(text), rb_utf8_encoding());
    rb_gc_register_address(slot);
}

void Init_http_head(void) {
    for (int c = 0; c < 256; c++) {
        target_byte[c] = (c > 0x20 && c < 0x7f) || c >= 0x80;
        value_byte[c] = (c >= 0x20 && c < 0x7f) || c == '\t' || c >= 0x80;
        nb_token_byte[c] = (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') ||
                        (c != 0 && strchr("!#$%&'*+-.^_`|~", c) != NULL);
        host_byte[c] = (c >= '0' && c <= '9') || (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || c == '.' || c == '-';
    }
    // The same frozen Strings as the Ruby path's literals (UTF-8, interned).
    intern(&key_request_method, "REQUEST_METHOD");
    intern(&key_server_protocol, "SERVER_PROTOCOL");
    intern(&key_path_info, "PATH_INFO");
    intern(&key_query_string, "QUERY_STRING");
    intern(&key_server_name, "SERVER_NAME");
    intern(&key_server_port, "SERVER_PORT");
    intern(&key_early_hints, "rack.early_hints");
    intern(&protocol11, "HTTP/1.1");
    intern(&protocol10, "HTTP/1.0");
    intern(&empty_query, "");
    intern(&default_port80, "80");
    static const char *const methods[] = { NULL, "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH" };
    for (int id = METHOD_GET; id <= METHOD_PATCH; id++) {
        method_names[id] = rb_enc_interned_str(methods[id], (long)strlen(methods[id]), rb_ascii8bit_encoding());
        rb_gc_register_address(&method_names[id]);
    }

    VALUE neverblock = rb_define_module("NeverBlock");
    VALUE klass = rb_define_class_under(neverblock, "HTTPHead", rb_cObject);
    rb_define_alloc_func(klass, nb_head_alloc);
    rb_define_method(klass, "initialize", nb_head_initialize, 7);
    rb_define_method(klass, "parse", nb_head_parse, 2);
    rb_define_method(klass, "head_end", nb_head_head_end, 0);
    rb_define_method(klass, "content_length", nb_head_content_length, 0);
    rb_define_method(klass, "head?", nb_head_head_p, 0);
    rb_define_method(klass, "http10?", nb_head_http10_p, 0);
    rb_define_method(klass, "keep_alive?", nb_head_keep_alive_p, 0);
    nb_response_head_init(klass);
}
