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

#include "aio_queues.h"   // Request, Chunk, Slot, blocking_io, Uring, KernelAio

namespace {

class Engine {
 public:
  Engine(int backend, int64_t block_size, int queue_depth, int threads, bool single_submit, bool overlap_events,
         int64_t align)
      : backend_(backend), block_(block_size), qd_(queue_depth), single_submit_(single_submit),
        overlap_(overlap_events), align_(align) {
    int n = backend == kThreads ? threads * queue_depth : threads;
    try {
      for (int i = 0; i < n; ++i)
        workers_.emplace_back([this] { backend_ == kThreads ? run_blocking() : run_async(); });
    } catch (...) {  // out of threads: join the ones started (a joinable std::thread destroyed would abort)
      stop_workers();
      throw;
    }
  }

  ~Engine() { stop_workers(); }

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
      // Finish a short transfer synchronously (a write that hit a limit reports why; buffered io_uring reads may
      // come back short). An unaligned short O_DIRECT read is the end of the file: retrying would only get EINVAL.
      bool retry = c.write || !c.direct || res % align_ == 0;
      if (res < need && retry) res = blocking_io(c, s.io_buf, s.io_len, res);
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

  void stop_workers() {
    {
      std::lock_guard<std::mutex> g(qm_);
      stop_ = true;
    }
    qcv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
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
  try {  // no C++ exception may cross the C ABI: it would abort the process
    return new Engine(backend, block_size, queue_depth, threads, single_submit != 0, overlap_events != 0, align);
  } catch (...) {
    return nullptr;
  }
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
