// A libFuzzer harness for NeverBlock::HTTPHead#parse (ext/neverblock/http_head),
// built by `bin/fuzz --libfuzzer` with clang: the extension's source is compiled
// into this program with coverage instrumentation (-fsanitize=fuzzer-no-link) and
// ASan and UBSan, linked against the system's libruby, which main() starts
// before it hands over to libFuzzer (LLVMFuzzerRunDriver). Where the Ruby
// fuzzer (test/fuzz/targets/http_head.rb) mutates blindly and checks the
// parse's contract, libFuzzer keeps the inputs that reach new branches of the
// C, so it goes deeper for the same time; its only oracles are the sanitizers.
//
// An input is three bytes of parameters, then the data:
//   byte 0, bit i (i = 0..3): limit i (max_target, max_header_bytes,
//     max_headers, max_body) is tiny: TINY[(byte 1 >> 2i) & 3]; else PERMISSIVE[i]
//   byte 2, bit 0: the base env is the server's (else empty); the other
//     bits: one more offset to parse at, (byte 2 >> 1) modulo the data's size + 1
// The data is parsed at offset 0 and on at each message boundary the parse
// reports (as the Parser walks a pipeline), then at that one offset. The
// String handed to #parse wraps libFuzzer's own buffer (rb_str_new_static):
// its bytes end where the buffer does, with no NUL after them, so a read one
// byte too far is reported.
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include "../../ext/neverblock/http_head/http_head.c"

int LLVMFuzzerRunDriver(int *argc, char ***argv, int (*callback)(const uint8_t *data, size_t size));

static const long PERMISSIVE[4] = {2048, 8192, 40, 65536};
static const long TINY[4] = {0, 1, 4, 16};
static VALUE head_class, server_env, empty_env;

typedef struct {
    const uint8_t *data;
    size_t size;
} fuzz_input;

// One input (under rb_protect: #parse raises nothing for an offset within the data).
static VALUE run_input(VALUE argument) {
    const fuzz_input *input = (const fuzz_input *)argument;
    const uint8_t *params = input->data;
    long size = (long)input->size - 3;
    VALUE args[7];
    args[0] = (params[2] & 1) ? server_env : empty_env;
    args[1] = rb_str_new_cstr("localhost");
    args[2] = rb_str_new_cstr("8080");
    for (int i = 0; i < 4; i++) {
        long limit = (params[0] >> i) & 1 ? TINY[(params[1] >> (2 * i)) & 3] : PERMISSIVE[i];
        args[3 + i] = LONG2NUM(limit);
    }
    VALUE head = rb_class_new_instance(7, args, head_class);
    VALUE data = rb_str_new_static((const char *)input->data + 3, size);
    long offset = 0;
    for (int step = 0; step < 16 && offset < size; step++) {
        if (NIL_P(nb_head_parse(head, data, LONG2NUM(offset)))) break;
        nb_head_t *parsed = nb_head_get(head);
        offset = parsed->head_end + parsed->content_length;
    }
    nb_head_parse(head, data, LONG2NUM((long)(params[2] >> 1) % (size + 1)));
    RB_GC_GUARD(data);
    return Qnil;
}

static int fuzz_one(const uint8_t *data, size_t size) {
    if (size < 3) return 0;
    fuzz_input input = {data, size};
    int state = 0;
    rb_protect(run_input, (VALUE)&input, &state);
    if (state) {
        VALUE error = rb_errinfo();
        fprintf(stderr, "HTTPHead#parse raised %s\n", RSTRING_PTR(rb_inspect(error)));
        abort();
    }
    return 0;
}

int main(int argc, char **argv) {
    ruby_sysinit(&argc, &argv);
    RUBY_INIT_STACK; // in main's frame: Ruby's GC scans the stack from here down
    ruby_init();
    Init_http_head();
    head_class = rb_path2class("NeverBlock::HTTPHead");
    empty_env = rb_hash_new();
    server_env = rb_hash_new();
    rb_hash_aset(server_env, rb_str_new_cstr("SCRIPT_NAME"), rb_str_new_cstr(""));
    rb_hash_aset(server_env, rb_str_new_cstr("REMOTE_ADDR"), rb_str_new_cstr("127.0.0.1"));
    rb_hash_aset(server_env, rb_str_new_cstr("rack.early_hints"), ID2SYM(rb_intern("early_hints")));
    rb_gc_register_address(&empty_env);
    rb_gc_register_address(&server_env);
    // Ruby turns these into exceptions, raised at its next check, inside
    // #parse; libFuzzer keeps a handler it finds, and needs its own: SIGALRM
    // ends an input that runs too long (-timeout), SIGINT and SIGTERM stop
    // the run. (Ruby keeps SIGSEGV: its report aborts, which libFuzzer catches.)
    signal(SIGALRM, SIG_DFL);
    signal(SIGINT, SIG_DFL);
    signal(SIGTERM, SIG_DFL);
    return LLVMFuzzerRunDriver(&argc, &argv, fuzz_one);
}
