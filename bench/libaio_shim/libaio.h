/* A minimal libaio-compatible API over the kernel AIO system calls, written for fsdpzero's benchmarks: DeepSpeed's
 * async_io op (ZeRO-Infinity) needs <libaio.h> and -laio at build time, and GPU hosts without the libaio-dev
 * package (and without internet) cannot build it. Only what DeepSpeed uses is declared. See build.sh. */
#ifndef FSDPZERO_LIBAIO_SHIM_H
#define FSDPZERO_LIBAIO_SHIM_H
#include <signal.h>
#include <string.h>
#include <time.h>
#ifdef __cplusplus
extern "C" {
#endif

typedef struct io_context *io_context_t;

typedef enum io_iocb_cmd { IO_CMD_PREAD = 0, IO_CMD_PWRITE = 1, IO_CMD_FSYNC = 2, IO_CMD_FDSYNC = 3,
                           IO_CMD_NOOP = 6 } io_iocb_cmd_t;

struct io_iocb_common {          /* the tail of the kernel's struct iocb (linux/aio_abi.h), x86-64 / little endian */
    void *buf;
    unsigned long nbytes;
    long long offset;
    long long __reserved2;
    unsigned flags;
    unsigned resfd;
};

struct iocb {                    /* same layout as the kernel's struct iocb */
    void *data;
    unsigned key;
    unsigned aio_rw_flags;
    short aio_lio_opcode;
    short aio_reqprio;
    int aio_fildes;
    union { struct io_iocb_common c; } u;
};

struct io_event {                /* same layout as the kernel's struct io_event */
    void *data;
    struct iocb *obj;
    unsigned long res;
    unsigned long res2;
};

/* All return the number done (>= 0) or a negative errno, as libaio does. */
int io_queue_init(int maxevents, io_context_t *ctxp);
int io_queue_release(io_context_t ctx);
int io_setup(int maxevents, io_context_t *ctxp);
int io_destroy(io_context_t ctx);
int io_submit(io_context_t ctx, long nr, struct iocb *ios[]);
int io_cancel(io_context_t ctx, struct iocb *iocb, struct io_event *evt);
int io_getevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout);
int io_pgetevents(io_context_t ctx, long min_nr, long nr, struct io_event *events, struct timespec *timeout,
                  sigset_t *sigmask);

static inline void io_prep_rw_(struct iocb *iocb, int op, int fd, void *buf, size_t count, long long offset) {
    memset(iocb, 0, sizeof(*iocb));
    iocb->aio_fildes = fd;
    iocb->aio_lio_opcode = (short)op;
    iocb->u.c.buf = buf;
    iocb->u.c.nbytes = count;
    iocb->u.c.offset = offset;
}
static inline void io_prep_pread(struct iocb *iocb, int fd, void *buf, size_t count, long long offset) {
    io_prep_rw_(iocb, IO_CMD_PREAD, fd, buf, count, offset);
}
static inline void io_prep_pwrite(struct iocb *iocb, int fd, void *buf, size_t count, long long offset) {
    io_prep_rw_(iocb, IO_CMD_PWRITE, fd, buf, count, offset);
}

#ifdef __cplusplus
}
#endif
#endif
