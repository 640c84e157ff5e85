// NeverBlock::HTTPHead.response_headers: the server's fast path from a Rack
// response's headers to the lines of its head (NeverBlock::Server::Response#write,
// lib/neverblock/server/response.rb).
//
// Response#write walks the app's headers in Ruby: it leaves out the `rack.`
// ones, notes the framing headers (content-length, transfer-encoding, date,
// and connection, which it drops and reads for `close`) and appends a
// `name: value` line for each of the others. For a hello world that walk was
// about 7 % of a keep-alive request's CPU (3.4 + YJIT). This does the same
// walk in C, but only for what it can do with the same result, and declines
// (returns nil, the head as it was) everything else, which the Ruby walk then
// does from the start: headers whose `each` is not Hash's own (a subclass's,
// a singleton's), a key that is not a plain String (a subclass or a singleton
// method could answer `start_with?` its own way) or not an HTTP token (the
// Ruby walk leaves out one that would split the head), a value that is not a
// plain String or a plain Array of them (Ruby calls `to_s` and `each`), a key
// or value that is not ASCII (Ruby's `<<` checks encodings), a value with CR
// or LF (Ruby splits it into lines), a head whose encoding is not
// ASCII-compatible. Names are compared in ASCII, whatever the process's
// locale (glibc's strncasecmp follows it: in a Turkish one `I` is not `i`).
// So every head it writes is byte for byte the Ruby walk's
// (test/neverblock/server/response_head_test.rb compares the two).
//
// Written for NeverBlock from the Ruby walk it stands in for; no code is
// taken from elsewhere.
#include <ruby.h>
#include <ruby/encoding.h>
#include <ruby/st.h>
#include <string.h>

static ID id_each;

// RFC 9110 tchar: the bytes of a header name (http_head.c's table, filled by
// Init_http_head before it calls nb_response_head_init).
extern unsigned char nb_token_byte[256];

// The flags #response_headers returns (Response::HEAD_* in Ruby).
enum {
    FLAG_LENGTH = 1,  // a content-length header (its value in out[0])
    FLAG_FRAMED = 2,  // a transfer-encoding header: the app frames the body
    FLAG_DATED = 4,   // a date header
    FLAG_CLOSE = 8    // a connection header that says close
};

typedef struct {
    VALUE head;  // the head being written
    VALUE out;   // out[0]: the content-length header's value
    int flags;
    int declined;
} walk_t;

// Whether `str` is a String (not a subclass's, nor one with singleton
// methods) of ASCII bytes only (its code range is cached).
static int ascii_string(VALUE str) {
    return RB_TYPE_P(str, T_STRING) && RBASIC_CLASS(str) == rb_cString &&
           rb_enc_str_coderange(str) == ENC_CODERANGE_7BIT;
}

// Whether the bytes of `key` (a String) are an HTTP token.
static int token(VALUE key) {
    const unsigned char *bytes = (const unsigned char *)RSTRING_PTR(key);
    long length = RSTRING_LEN(key);
    if (length == 0) return 0;
    for (long at = 0; at < length; at++) {
        if (!nb_token_byte[bytes[at]]) return 0;
    }
    return 1;
}

// Whether `str`'s bytes hold CR or LF.
static int has_line_break(VALUE str) {
    const char *bytes = RSTRING_PTR(str);
    long length = RSTRING_LEN(str);
    return memchr(bytes, '\r', (size_t)length) != NULL || memchr(bytes, '\n', (size_t)length) != NULL;
}

// Whether `str` (ASCII) contains "close" in any case (Ruby:
// value.downcase.include?("close")).
static int says_close(VALUE str) {
    const char *bytes = RSTRING_PTR(str);
    long length = RSTRING_LEN(str);
    for (long at = 0; at + 5 <= length; at++) {
        if (st_locale_insensitive_strncasecmp(bytes + at, "close", 5) == 0) return 1;
    }
    return 0;
}

// Appends `key: value\r\n`, or returns 0 for a value the Ruby walk must write.
static int add_line(VALUE head, VALUE key, VALUE value) {
    if (!ascii_string(value) || has_line_break(value)) return 0;
    rb_str_buf_cat(head, RSTRING_PTR(key), RSTRING_LEN(key));
    rb_str_buf_cat(head, ": ", 2);
    rb_str_buf_cat(head, RSTRING_PTR(value), RSTRING_LEN(value));
    rb_str_buf_cat(head, "\r\n", 2);
    RB_GC_GUARD(key); // (their bytes were read while head grew, which may run the GC)
    RB_GC_GUARD(value);
    return 1;
}

// Appends a line for `value`, or one for each String of an Array (Rack 3).
static int add_header(VALUE head, VALUE key, VALUE value) {
    if (!RB_TYPE_P(value, T_ARRAY)) return add_line(head, key, value);
    if (RBASIC_CLASS(value) != rb_cArray) return 0; // its `each` may be its own
    long count = RARRAY_LEN(value);
    for (long index = 0; index < count; index++) {
        if (!add_line(head, key, RARRAY_AREF(value, index))) return 0;
    }
    return 1;
}

// Whether `key` (ASCII, `length` bytes) is `name` in any case.
static int named(VALUE key, long length, const char *name, long name_length) {
    return length == name_length && st_locale_insensitive_strncasecmp(RSTRING_PTR(key), name, (size_t)length) == 0;
}

static int walk_header(VALUE key, VALUE value, VALUE data) {
    walk_t *walk = (walk_t *)data;
    if (!ascii_string(key)) {
        walk->declined = 1;
        return ST_STOP;
    }
    long length = RSTRING_LEN(key);
    if (length >= 5 && memcmp(RSTRING_PTR(key), "rack.", 5) == 0) return ST_CONTINUE; // for the server, not the client
    if (!token(key)) { // written as the Ruby walk writes it
        walk->declined = 1;
        return ST_STOP;
    }

    if (named(key, length, "content-length", 14)) {
        walk->flags |= FLAG_LENGTH;
        rb_ary_store(walk->out, 0, value);
    } else if (named(key, length, "transfer-encoding", 17)) {
        walk->flags |= FLAG_FRAMED;
    } else if (named(key, length, "date", 4)) {
        walk->flags |= FLAG_DATED;
    } else if (named(key, length, "connection", 10)) {
        if (!ascii_string(value)) { // an Array's to_s, or another object's: the Ruby walk's
            walk->declined = 1;
            return ST_STOP;
        }
        if (says_close(value)) walk->flags |= FLAG_CLOSE;
        return ST_CONTINUE; // the server writes its own
    }
    if (!add_header(walk->head, key, value)) {
        walk->declined = 1;
        return ST_STOP;
    }
    return ST_CONTINUE;
}

// NeverBlock::HTTPHead.response_headers(head, headers, out): appends the
// lines of `headers` (a Hash) to `head`. Returns the FLAG_* bits (with the
// content-length header's value in out[0]), or nil, `head` unchanged, for
// headers the Ruby walk must write (see the top of this file).
static VALUE nb_response_headers(VALUE self, VALUE head, VALUE headers, VALUE out) {
    Check_Type(head, T_STRING);
    Check_Type(out, T_ARRAY);
    if (!RB_TYPE_P(headers, T_HASH)) return Qnil; // (Rack 2 allowed any `each` of pairs)
    // Headers walked by an `each` of their own (a subclass's, a singleton's,
    // a redefined Hash#each), and a head Ruby's `<<` would check otherwise.
    if (!rb_method_basic_definition_p(CLASS_OF(headers), id_each) || !rb_enc_asciicompat(rb_enc_get(head))) return Qnil;
    rb_str_modify(head);
    long before = RSTRING_LEN(head);
    walk_t walk = { head, out, 0, 0 };
    rb_hash_foreach(headers, walk_header, (VALUE)&walk);
    if (walk.declined) {
        rb_str_set_len(head, before);
        return Qnil;
    }
    return INT2FIX(walk.flags);
}

// NeverBlock::HTTPHead.head_buffer(line, capacity): a new String holding
// `line` (a status line), in its encoding, with room for `capacity` bytes
// made at once. On Ruby 3.2+ (Variable Width Allocation) a capacity that fits
// an object slot keeps the bytes in the String's own slot: a response head
// that fits then costs no malloc, no realloc as its header lines are
// appended, and no free when it is swept. String.new(line, capacity: n)
// would allocate a Hash for its keyword on every call.
static VALUE nb_head_buffer(VALUE self, VALUE line, VALUE capacity) {
    StringValue(line);
    long capa = NUM2LONG(capacity);
    if (capa < RSTRING_LEN(line)) capa = RSTRING_LEN(line);
    VALUE head = rb_str_buf_new(capa);
    rb_enc_copy(head, line);
    rb_str_buf_cat(head, RSTRING_PTR(line), RSTRING_LEN(line));
    RB_GC_GUARD(line);
    return head;
}

void nb_response_head_init(VALUE klass) {
    id_each = rb_intern("each");
    rb_define_singleton_method(klass, "response_headers", nb_response_headers, 3);
    rb_define_singleton_method(klass, "head_buffer", nb_head_buffer, 2);
}
