// Async file I/O for swapping tensors to NVMe: a plain C ABI (loaded with ctypes, no torch headers, so the build
// takes seconds). A request (one buffer, one file range) is cut into block_size chunks; all chunks go to one shared
// queue drained by `intra_op_parallelism` workers. Each worker keeps up to `queue_depth` chunks in flight on its
// own kernel queue:
//   io_uring  raw io_uring_setup/io_uring_enter (no liburing needed)
//   libaio    the kernel AIO syscalls io_setup/io_submit/io_getevents (no libaio needed)
//   threads   intra_op_parallelism * queue_depth threads over blocking pread/pwrite (portable fallback)
// O_DIRECT wants buffer address, length and file offset aligned; offsets are aligned by the caller, and a chunk
// whose buffer or length is not goes through a per-slot aligned bounce buffer (writes are zero-padded up to the
// alignment, so a tensor of odd size occupies round_up(nbytes, align) bytes of its file).
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

class Engine {
 public:
  Engine(int backend, int64_t block_size, int queue_depth, int threads, bool single_submit, bool overlap_events,
         int64_t align)
      : backend_(backend), block_(block_size), qd_(queue_depth), single_submit_(single_submit),
        overlap_(overlap_events), align_(align) {
    int n = backend == kThreads ? threads * queue_depth : threads;
    for (int i = 0; i < n; ++i) workers_.emplace_back([this] { backend_ == kThreads ? run_blocking() : run_async(); });
  }

  ~Engine() {
    {
      std::lock_guard<std::mutex> g(qm_);
      stop_ = true;
    }
    qcv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  int64_t submit(int fd, bool write, char* buf, int64_t nbytes, int64_t offset) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) return -errno;
    bool direct = (fl & O_DIRECT) != 0;
    if (direct && offset % align_) return -EINVAL;
    if (nbytes < 0) return -EINVAL;
    auto req = std::make_shared<Request>();
    int64_t nchunks = nbytes ? (nbytes + block_ - 1) / block_ : 0;
    req->pending.store(nchunks);
    if (!nchunks) req->done = true;
    int64_t id;
    {
      std::lock_guard<std::mutex> g(rm_);
      id = ++next_id_;
      requests_[id] = req;
    }
    {
      std::lock_guard<std::mutex> g(qm_);
      for (int64_t k = 0; k < nchunks; ++k) {
        int64_t at = k * block_;
        int64_t len = nbytes - at < block_ ? nbytes - at : block_;
        queue_.push_back(Chunk{req, fd, write, direct, buf + at, len, offset + at});
      }
    }
    qcv_.notify_all();
    return id;
  }

  std::shared_ptr<Request> find(int64_t id) {
    std::lock_guard<std::mutex> g(rm_);
    auto it = requests_.find(id);
    return it == requests_.end() ? nullptr : it->second;
  }

  void forget(int64_t id) {
    std::lock_guard<std::mutex> g(rm_);
    requests_.erase(id);
  }

 private:
  // Take up to `max` chunks; blocks only when `block` and the queue is empty. Returns false on shutdown.
  bool take(std::vector<Chunk>& out, size_t max, bool block) {
    std::unique_lock<std::mutex> g(qm_);
    if (block) qcv_.wait(g, [this] { return stop_ || !queue_.empty(); });
    while (!queue_.empty() && out.size() < max) {
      out.push_back(std::move(queue_.front()));
      queue_.pop_front();
    }
    return !(stop_ && queue_.empty() && out.empty());
  }

  // Point the slot at the caller's buffer, or at its bounce buffer when O_DIRECT alignment is not met.
  bool prepare(Slot& s) {
    const Chunk& c = s.c;
    bool aligned = !c.direct || ((uintptr_t)c.buf % align_ == 0 && c.len % align_ == 0);
    if (aligned) {
      s.io_buf = c.buf;
      s.io_len = c.len;
      return true;
    }
    if (!s.bounce) {
      void* p = nullptr;
      if (posix_memalign(&p, (size_t)align_, (size_t)round_up(block_, align_))) return false;
      s.bounce = (char*)p;
    }
    s.io_buf = s.bounce;
    s.io_len = round_up(c.len, align_);
    if (c.write) {
      memcpy(s.bounce, c.buf, c.len);
      memset(s.bounce + c.len, 0, s.io_len - c.len);
    }
    return true;
  }

  // Result of the kernel op (bytes or -errno) -> finish the chunk, completing a short transfer synchronously.
  void complete(Slot& s, int64_t res) {
    const Chunk& c = s.c;
    int error = 0;
    if (res < 0) {
      error = (int)-res;
    } else {
      int64_t need = s.io_buf == s.bounce && !c.write ? c.len : s.io_len;  // bounce reads may stop at EOF past len
      if (res < need) res = blocking_io(c, s.io_buf, s.io_len, res);
      if (res < 0) error = (int)-res;
      else if (res < need) error = c.write ? ENOSPC : ENODATA;
      else if (s.io_buf == s.bounce && !c.write) memcpy(c.buf, s.bounce, c.len);
    }
    s.busy = false;
    auto req = std::move(s.c.req);
    req->chunk_finished(error, c.off);
  }

  void run_blocking() {
    Slot s;
    std::vector<Chunk> got;
    while (true) {
      got.clear();
      if (!take(got, 1, true)) break;
      if (got.empty()) continue;
      s.c = std::move(got[0]);
      if (!prepare(s)) {
        s.c.req->chunk_finished(ENOMEM, s.c.off);
        s.c.req.reset();
        continue;
      }
      complete(s, blocking_io(s.c, s.io_buf, s.io_len, 0));
    }
    free(s.bounce);
  }

  void run_async() {
    std::vector<Slot> slots(qd_);
    Uring uring;
    KernelAio kaio;
    int init = backend_ == kIoUring ? uring.init((unsigned)qd_) : kaio.init((unsigned)qd_);
    int inflight = 0;
    std::vector<Chunk> got;
    auto on_done = [&](int index, int64_t res) {
      complete(slots[index], res);
      --inflight;
    };
    while (true) {
      // Refill: overlap_events tops the queue up after every completion; otherwise waves of queue_depth.
      got.clear();
      size_t room = (size_t)(qd_ - inflight);
      if ((overlap_ || inflight == 0) && !take(got, room, inflight == 0) && inflight == 0) break;
      for (auto& c : got) {
        int index = 0;
        while (slots[index].busy) ++index;
        Slot& s = slots[index];
        s.c = std::move(c);
        s.busy = true;
        int r = init < 0 ? init : (prepare(s) ? 0 : -ENOMEM);
        if (r == 0) r = backend_ == kIoUring ? uring.queue(s, index) : kaio.queue(s, index);
        if (r < 0) {
          complete(s, r);
          continue;
        }
        ++inflight;
        if (single_submit_) submit(uring, kaio, slots, inflight, true);
      }
      if (!single_submit_ && !got.empty()) submit(uring, kaio, slots, inflight, false);
      if (inflight == 0) continue;
      int want = overlap_ ? 1 : inflight;
      int r = backend_ == kIoUring ? uring.reap(want, on_done) : kaio.reap(want, on_done);
      if (r < 0) {  // the completion queue itself failed (a bug, not an I/O error): fail what is in flight
        for (auto& s : slots)
          if (s.busy) {
            complete(s, r);
            --inflight;
          }
      }
    }
    for (auto& s : slots) free(s.bounce);
  }

  void submit(Uring& uring, KernelAio& kaio, std::vector<Slot>& slots, int& inflight, bool one) {
    std::vector<int> dropped;
    int r = backend_ == kIoUring ? uring.submit(one, dropped) : kaio.submit(one, dropped);
    if (r == 0) return;
    for (int index : dropped) {
      complete(slots[index], r);
      --inflight;
    }
  }

  int backend_;
  int64_t block_;
  int qd_;
  bool single_submit_, overlap_;
  int64_t align_;
  std::vector<std::thread> workers_;
  std::mutex qm_;
  std::condition_variable qcv_;
  std::deque<Chunk> queue_;
  bool stop_ = false;
  std::mutex rm_;
  std::unordered_map<int64_t, std::shared_ptr<Request>> requests_;
  int64_t next_id_ = 0;
};

}  // namespace

extern "C" {

// 1 if the kernel lets this process use the backend (io_uring can be disabled by sysctl or seccomp).
int fz_aio_backend_available(int backend) {
  if (backend == kThreads) return 1;
  if (backend == kIoUring) {
    Uring u;
    return u.init(4) == 0;
  }
  if (backend == kLibaio) {
    KernelAio k;
    return k.init(4) == 0;
  }
  return 0;
}

void* fz_aio_create(int backend, int64_t block_size, int queue_depth, int threads, int single_submit,
                    int overlap_events, int64_t align) {
  if (block_size <= 0 || queue_depth <= 0 || threads <= 0 || align <= 0 || block_size % align) return nullptr;
  return new Engine(backend, block_size, queue_depth, threads, single_submit != 0, overlap_events != 0, align);
}

void fz_aio_destroy(void* engine) { delete static_cast<Engine*>(engine); }

// Returns a request id > 0, or -errno for a request that cannot be queued.
int64_t fz_aio_submit(void* engine, int fd, int write, void* buf, int64_t nbytes, int64_t offset) {
  return static_cast<Engine*>(engine)->submit(fd, write != 0, static_cast<char*>(buf), nbytes, offset);
}

// 1 done, 0 in flight, -EINVAL unknown id.
int fz_aio_poll(void* engine, int64_t id) {
  auto req = static_cast<Engine*>(engine)->find(id);
  if (!req) return -EINVAL;
  std::lock_guard<std::mutex> g(req->m);
  return req->done ? 1 : 0;
}

// Blocks until the request is done and forgets it. Returns 0 or the first errno (negated); *err_offset gets the
// file offset of the chunk that failed.
int fz_aio_wait(void* engine, int64_t id, int64_t* err_offset) {
  auto* e = static_cast<Engine*>(engine);
  auto req = e->find(id);
  if (!req) return -EINVAL;
  {
    std::unique_lock<std::mutex> g(req->m);
    req->cv.wait(g, [&] { return req->done; });
  }
  e->forget(id);
  *err_offset = req->err_offset.load();
  return -req->err.load();
}

}  // extern "C"
