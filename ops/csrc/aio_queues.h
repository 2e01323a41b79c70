// The pieces of the async I/O engine (ops/csrc/aio.cpp) below the Engine: request/chunk bookkeeping, the blocking
// fallback, and the two kernel queues (raw io_uring and the kernel AIO syscalls). Included by aio.cpp only,
// whose Engine drives them; an anonymous namespace keeps all of it private to that one translation unit.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <linux/aio_abi.h>
#include <linux/io_uring.h>

namespace {


enum Backend { kIoUring = 0, kLibaio = 1, kThreads = 2 };

struct Request {
  std::atomic<int64_t> pending{0};
  std::atomic<int> err{0};                 // first errno seen, positive
  std::atomic<int64_t> err_offset{-1};     // file offset of the failing chunk
  std::mutex m;
  std::condition_variable cv;
  bool done = false;

  void chunk_finished(int error, int64_t offset) {
    if (error) {
      int expected = 0;
      if (err.compare_exchange_strong(expected, error)) err_offset.store(offset);
    }
    if (pending.fetch_sub(1) == 1) {
      std::lock_guard<std::mutex> g(m);
      done = true;
      cv.notify_all();
    }
  }
};

struct Chunk {
  std::shared_ptr<Request> req;
  int fd;
  bool write;
  bool direct;   // fd has O_DIRECT: alignment rules apply
  char* buf;
  int64_t len;
  int64_t off;
};

// A chunk being serviced, with the buffer actually handed to the kernel (the caller's, or the aligned bounce).
struct Slot {
  Chunk c;
  char* io_buf = nullptr;
  int64_t io_len = 0;
  char* bounce = nullptr;
  bool busy = false;
};

int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Synchronous loop over pread/pwrite; used by the threads backend and to finish a short async completion.
int64_t blocking_io(const Chunk& c, char* buf, int64_t len, int64_t done_bytes) {
  while (done_bytes < len) {
    ssize_t r = c.write ? pwrite(c.fd, buf + done_bytes, len - done_bytes, c.off + done_bytes)
                        : pread(c.fd, buf + done_bytes, len - done_bytes, c.off + done_bytes);
    if (r < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    done_bytes += r;
    if (r == 0 || (!c.write && done_bytes < len)) break;  // a short read of a regular file: end of file
  }
  return done_bytes;
}

struct Uring {
  int fd = -1;
  unsigned *sq_head, *sq_tail, *sq_mask, *sq_array, *cq_head, *cq_tail, *cq_mask;
  io_uring_sqe* sqes = nullptr;
  io_uring_cqe* cqes = nullptr;
  void *sq_ptr = MAP_FAILED, *cq_ptr = MAP_FAILED;
  size_t sq_bytes = 0, cq_bytes = 0, sqe_bytes = 0;
  std::vector<int> staged;   // slot indices queued in the SQ ring, oldest first

  int init(unsigned entries) {
    io_uring_params p;
    memset(&p, 0, sizeof p);
    fd = (int)syscall(__NR_io_uring_setup, entries, &p);
    if (fd < 0) return -errno;
    sq_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_bytes = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_bytes = cq_bytes = sq_bytes > cq_bytes ? sq_bytes : cq_bytes;
    sq_ptr = mmap(nullptr, sq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (sq_ptr == MAP_FAILED) return -errno;
    cq_ptr = single ? sq_ptr
                    : mmap(nullptr, cq_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                           IORING_OFF_CQ_RING);
    if (cq_ptr == MAP_FAILED) return -errno;
    sqe_bytes = p.sq_entries * sizeof(io_uring_sqe);
    void* s = mmap(nullptr, sqe_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (s == MAP_FAILED) return -errno;
    sqes = (io_uring_sqe*)s;
    char* sq = (char*)sq_ptr;
    char* cq = (char*)cq_ptr;
    sq_head = (unsigned*)(sq + p.sq_off.head);
    sq_tail = (unsigned*)(sq + p.sq_off.tail);
    sq_mask = (unsigned*)(sq + p.sq_off.ring_mask);
    sq_array = (unsigned*)(sq + p.sq_off.array);
    cq_head = (unsigned*)(cq + p.cq_off.head);
    cq_tail = (unsigned*)(cq + p.cq_off.tail);
    cq_mask = (unsigned*)(cq + p.cq_off.ring_mask);
    cqes = (io_uring_cqe*)(cq + p.cq_off.cqes);
    return 0;
  }
  ~Uring() {
    if (sqes) munmap(sqes, sqe_bytes);
    if (cq_ptr != MAP_FAILED && cq_ptr != sq_ptr) munmap(cq_ptr, cq_bytes);
    if (sq_ptr != MAP_FAILED) munmap(sq_ptr, sq_bytes);
    if (fd >= 0) close(fd);
  }
  int queue(Slot& s, int index) {
    unsigned tail = *sq_tail;  // only this worker writes the tail
    unsigned i = tail & *sq_mask;
    io_uring_sqe* e = &sqes[i];
    memset(e, 0, sizeof *e);
    e->opcode = s.c.write ? IORING_OP_WRITE : IORING_OP_READ;
    e->fd = s.c.fd;
    e->addr = (uint64_t)(uintptr_t)s.io_buf;
    e->len = (uint32_t)s.io_len;
    e->off = (uint64_t)s.c.off;
    e->user_data = (uint64_t)index;
    sq_array[i] = i;
    __atomic_store_n(sq_tail, tail + 1, __ATOMIC_RELEASE);
    staged.push_back(index);
    return 0;
  }
  int enter(unsigned to_submit, unsigned min_complete) {
    for (;;) {
      int r = (int)syscall(__NR_io_uring_enter, fd, to_submit, min_complete,
                           min_complete ? IORING_ENTER_GETEVENTS : 0, nullptr, 0);
      if (r >= 0) return r;
      if (errno != EINTR) return -errno;
    }
  }
  // Hands the staged requests to the kernel. On failure the unconsumed ones are taken back out of the ring
  // (only this thread produces, and the kernel consumes only inside enter) and listed in `dropped`.
  int submit(bool /*one_at_a_time: the caller submits after each queue()*/, std::vector<int>& dropped) {
    size_t done = 0;
    while (done < staged.size()) {
      int r = enter((unsigned)(staged.size() - done), 0);
      if (r < 0) {
        __atomic_store_n(sq_tail, __atomic_load_n(sq_head, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
        dropped.assign(staged.begin() + done, staged.end());
        staged.clear();
        return r;
      }
      done += (size_t)r;
    }
    staged.clear();
    return 0;
  }
  template <class F> int reap(int min_complete, F on_done) {
    int seen = 0;
    for (;;) {
      unsigned head = *cq_head;
      unsigned tail = __atomic_load_n(cq_tail, __ATOMIC_ACQUIRE);
      while (head != tail) {
        io_uring_cqe* e = &cqes[head & *cq_mask];
        on_done((int)e->user_data, (int64_t)e->res);
        ++head;
        ++seen;
      }
      __atomic_store_n(cq_head, head, __ATOMIC_RELEASE);
      if (seen >= min_complete) return seen;
      int r = enter(0, (unsigned)(min_complete - seen));
      if (r < 0) return r;
    }
  }
};

struct KernelAio {
  aio_context_t ctx = 0;
  std::vector<iocb> cbs;
  std::vector<iocb*> staged;
  std::vector<io_event> events;

  int init(unsigned entries) {
    cbs.resize(entries);
    events.resize(entries);
    if (syscall(__NR_io_setup, entries, &ctx) < 0) return -errno;
    return 0;
  }
  ~KernelAio() {
    if (ctx) syscall(__NR_io_destroy, ctx);
  }
  int queue(Slot& s, int index) {
    iocb* cb = &cbs[index];
    memset(cb, 0, sizeof *cb);
    cb->aio_fildes = (uint32_t)s.c.fd;
    cb->aio_lio_opcode = s.c.write ? IOCB_CMD_PWRITE : IOCB_CMD_PREAD;
    cb->aio_buf = (uint64_t)(uintptr_t)s.io_buf;
    cb->aio_nbytes = (uint64_t)s.io_len;
    cb->aio_offset = s.c.off;
    cb->aio_data = (uint64_t)index;
    staged.push_back(cb);
    return 0;
  }
  // single_submit: one iocb per io_submit call; otherwise the whole batch in one call.
  int submit(bool one_at_a_time, std::vector<int>& dropped) {
    size_t i = 0;
    while (i < staged.size()) {
      long n = one_at_a_time ? 1 : (long)(staged.size() - i);
      long r = syscall(__NR_io_submit, ctx, n, staged.data() + i);
      if (r < 0) {
        if (errno == EINTR) continue;
        int err = -errno;
        for (size_t k = i; k < staged.size(); ++k) dropped.push_back((int)staged[k]->aio_data);
        staged.clear();
        return err;
      }
      i += (size_t)r;
    }
    staged.clear();
    return 0;
  }
  template <class F> int reap(int min_complete, F on_done) {
    int seen = 0;
    while (seen < min_complete) {
      long r = syscall(__NR_io_getevents, ctx, min_complete - seen, (long)events.size(), events.data(), nullptr);
      if (r < 0) {
        if (errno == EINTR) continue;
        return -errno;
      }
      for (long k = 0; k < r; ++k) on_done((int)events[k].data, (int64_t)events[k].res);
      seen += (int)r;
    }
    return seen;
  }
};

}  // namespace
