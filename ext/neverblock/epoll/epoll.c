// NeverBlock::Epoll: an epoll set of the server's own, for keep-alive
// connections that wait for their next request holding no fiber
// (NeverBlock::Server::IdleSet, lib/neverblock/server/idle_set.rb).
//
// The set's descriptor is itself pollable: one fiber waits on its
// readability through the scheduler, as on any IO, and then takes the ready
// descriptors with #ready, which never blocks (epoll_wait with a timeout of
// 0). Each descriptor is armed one-shot: it reports once, then stays in the
// set disarmed until #arm arms it again, so a connection handed to a fiber is
// never reported twice, and parking it again costs one epoll_ctl
// (EPOLL_CTL_MOD) rather than an EPOLL_CTL_DEL when it reports and an
// EPOLL_CTL_ADD when it parks. Closing a descriptor takes it out of the set
// (when no other descriptor refers to its socket: a disarmed one left behind
// by a dup, or a forked child, never reports).
#include <ruby.h>
#include <errno.h>
#include <unistd.h>
#include <sys/epoll.h>

// Events taken from the kernel per #ready call: more stay in the set, which
// then is still readable.
#define READY_MAX 256

typedef struct {
    int fd;
} nb_epoll_t;

static void nb_epoll_free(void *data) {
    nb_epoll_t *epoll = data;
    if (epoll->fd >= 0) close(epoll->fd);
    xfree(epoll);
}

static size_t nb_epoll_memsize(const void *data) {
    return sizeof(nb_epoll_t);
}

static const rb_data_type_t nb_epoll_type = {
    "NeverBlock::Epoll",
    {NULL, nb_epoll_free, nb_epoll_memsize},
    0, 0, RUBY_TYPED_FREE_IMMEDIATELY
};

static VALUE nb_epoll_alloc(VALUE klass) {
    nb_epoll_t *epoll;
    VALUE self = TypedData_Make_Struct(klass, nb_epoll_t, &nb_epoll_type, epoll);
    epoll->fd = -1;
    return self;
}

static nb_epoll_t *nb_epoll_open(VALUE self) {
    nb_epoll_t *epoll;
    TypedData_Get_Struct(self, nb_epoll_t, &nb_epoll_type, epoll);
    if (epoll->fd < 0) rb_raise(rb_eIOError, "closed NeverBlock::Epoll");
    return epoll;
}

// Epoll.new: a new epoll set (closed on exec, and never shared after a fork:
// each worker makes its own).
static VALUE nb_epoll_initialize(VALUE self) {
    nb_epoll_t *epoll;
    TypedData_Get_Struct(self, nb_epoll_t, &nb_epoll_type, epoll);
    // Once only: a second call (send(:initialize), a subclass calling super
    // twice) would drop the open set's descriptor unclosed.
    if (epoll->fd >= 0) rb_raise(rb_eRuntimeError, "NeverBlock::Epoll is already initialized");
    int fd = epoll_create1(EPOLL_CLOEXEC);
    if (fd < 0) rb_sys_fail("epoll_create1");
    epoll->fd = fd;
    return self;
}

// #fileno: the set's descriptor, to wait on (IO.for_fd(fileno, autoclose: false)).
static VALUE nb_epoll_fileno(VALUE self) {
    return INT2NUM(nb_epoll_open(self)->fd);
}

// #arm(fd): reports `fd` once when it is readable, or its peer hung up.
// A descriptor already in the set (disarmed since it reported, or armed) is
// re-armed with EPOLL_CTL_MOD; one not in it is added (EPOLL_CTL_ADD).
// Returns true when it was added, false when re-armed. Raises
// SystemCallError (EBADF for a closed descriptor).
static VALUE nb_epoll_arm(VALUE self, VALUE fd) {
    nb_epoll_t *epoll = nb_epoll_open(self);
    struct epoll_event event = {0};
    event.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT;
    event.data.fd = NUM2INT(fd);
    if (epoll_ctl(epoll->fd, EPOLL_CTL_MOD, event.data.fd, &event) == 0) return Qfalse;
    if (errno != ENOENT) rb_sys_fail("epoll_ctl(EPOLL_CTL_MOD)");
    if (epoll_ctl(epoll->fd, EPOLL_CTL_ADD, event.data.fd, &event) < 0) rb_sys_fail("epoll_ctl(EPOLL_CTL_ADD)");
    return Qtrue;
}

// #delete(fd): takes `fd` out of the set. Returns false when it was not in
// it (or is closed: the kernel drops a closed descriptor from every set).
static VALUE nb_epoll_delete(VALUE self, VALUE fd) {
    nb_epoll_t *epoll = nb_epoll_open(self);
    struct epoll_event event = {0}; // ignored, but kernels before 2.6.9 wanted one
    if (epoll_ctl(epoll->fd, EPOLL_CTL_DEL, NUM2INT(fd), &event) == 0) return Qtrue;
    if (errno == ENOENT || errno == EBADF) return Qfalse;
    rb_sys_fail("epoll_ctl(EPOLL_CTL_DEL)");
    return Qnil; // not reached
}

// #ready: the descriptors that reported since the last call (at most
// READY_MAX), without waiting; an empty Array when none did.
static VALUE nb_epoll_ready(VALUE self) {
    nb_epoll_t *epoll = nb_epoll_open(self);
    struct epoll_event events[READY_MAX];
    int count = epoll_wait(epoll->fd, events, READY_MAX, 0);
    if (count < 0) {
        if (errno == EINTR) return rb_ary_new();
        rb_sys_fail("epoll_wait");
    }
    VALUE fds = rb_ary_new_capa(count);
    for (int i = 0; i < count; i++) rb_ary_push(fds, INT2NUM(events[i].data.fd));
    return fds;
}

// #close: closes the set (its descriptors stay open). Closing twice is a no-op.
static VALUE nb_epoll_close(VALUE self) {
    nb_epoll_t *epoll;
    TypedData_Get_Struct(self, nb_epoll_t, &nb_epoll_type, epoll);
    if (epoll->fd >= 0) {
        close(epoll->fd);
        epoll->fd = -1;
    }
    return Qnil;
}

static VALUE nb_epoll_closed_p(VALUE self) {
    nb_epoll_t *epoll;
    TypedData_Get_Struct(self, nb_epoll_t, &nb_epoll_type, epoll);
    return epoll->fd < 0 ? Qtrue : Qfalse;
}

void Init_epoll(void) {
    VALUE neverblock = rb_define_module("NeverBlock");
    VALUE klass = rb_define_class_under(neverblock, "Epoll", rb_cObject);
    rb_define_alloc_func(klass, nb_epoll_alloc);
    rb_define_method(klass, "initialize", nb_epoll_initialize, 0);
    rb_define_method(klass, "fileno", nb_epoll_fileno, 0);
    rb_define_method(klass, "arm", nb_epoll_arm, 1);
    rb_define_method(klass, "delete", nb_epoll_delete, 1);
    rb_define_method(klass, "ready", nb_epoll_ready, 0);
    rb_define_method(klass, "close", nb_epoll_close, 0);
    rb_define_method(klass, "closed?", nb_epoll_closed_p, 0);
}
