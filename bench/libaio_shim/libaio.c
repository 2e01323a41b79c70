/* The calls declared in libaio.h, each one kernel system call (see libaio.h for why this exists). */
#include "libaio.h"

#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

static long ret_(long r) { return r < 0 ? -errno : r; }

int io_setup(int maxevents, io_context_t *ctxp) { return (int)ret_(syscall(SYS_io_setup, maxevents, ctxp)); }
int io_queue_init(int maxevents, io_context_t *ctxp) { *ctxp = 0; return io_setup(maxevents, ctxp); }
int io_destroy(io_context_t ctx) { return (int)ret_(syscall(SYS_io_destroy, ctx)); }
int io_queue_release(io_context_t ctx) { return io_destroy(ctx); }
int io_submit(io_context_t ctx, long nr, struct iocb *ios[]) { return (int)ret_(syscall(SYS_io_submit, ctx, nr, ios)); }
int io_cancel(io_context_t ctx, struct iocb *iocb, struct io_event *evt) {
    return (int)ret_(syscall(SYS_io_cancel, ctx, iocb, evt));
}
int io_getevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout) {
    long r;
    do {   /* a signal interrupting the wait is not an I/O error */
        r = syscall(SYS_io_getevents, ctx, min_nr, nr, events, timeout);
    } while (r < 0 && errno == EINTR);
    return (int)ret_(r);
}
int io_pgetevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout,
                  sigset_t *sigmask) {
    (void)sigmask;     /* DeepSpeed passes NULL: plain io_getevents */
    return io_getevents(ctx, min_nr, nr, events, timeout);
}
