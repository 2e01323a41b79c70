"""Speculative CPU Adam for the offload path: step each chunk while backward is still running, as soon as its
gradients have landed on the host, and keep the result only when it is exactly the step the engine then asks for.

Why it can be exact. The clip coefficient and the overflow verdict need the global gradient norm, which exists only
after backward. But clipping leaves the gradients alone whenever norm + 1e-6 <= gradient_clipping: the factor is
then exactly 1.0 (and without a loss scaler nothing else scales them), so a step taken with factor 1.0 before the
norm was known is bit for bit the step the engine takes. Each chunk is therefore stepped *out of place*
(`CPUAdam.step_param(into=...)`, the fused kernel reading the live fp32 master and moments and writing a shadow set),
and at step():
- factor == 1.0 and the same hyperparameters: commit, i.e. swap the live and shadow storages (no copy) and count
  the step;
- otherwise (clipped, skipped on overflow, a changed lr): the shadows are dropped and the path steps in place from
  the untouched live state, as without speculation.
Once step() has the factor, the worker stops taking chunks; the ones it did not reach are stepped in place (the
same computation) in forward order, after the committed ones.
Early stop: this rank's partial sum of squared gradients is a lower bound of the global one. Once it passes
gradient_clipping², the step will clip, and the rest of this backward is not speculated.
After a clipped step (auto, the knob unset, several local ranks): the next backward is not speculated at all. Clipping
comes in runs (the norm moves slowly from step to step), and a dropped speculation is not free where ranks share the
host: its CPU Adam takes the memory bandwidth the other ranks' steps and the copies need (4 ranks on one H200 host, 16
threads each: clipped steps 0.363 s with speculation against 0.312 s without, BENCHMARKS.md S14). The first unclipped
step of a run then steps after backward, as without speculation, and the next ones speculate again.

Cost: a second fp32 master and moments (12 bytes/param) and pinned low-precision buffer (2 bytes/param) in host
memory, for the chunks that are speculated: those of the last units (their gradients land first), within a budget
(fsdpzero.offload.build: by default 40% of the parameters, never more than half the memory available); the rest step
after backward as without speculation. The offload_speculate knob (on by default where grads are staged, i.e. on a
GPU); off with fp16 loss scaling (the factor is never 1.0) and with NVMe offload.
"""
from __future__ import annotations

import logging
import os
import queue
import threading
import time

import torch

log = logging.getLogger("fsdpzero")


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return int(text) if text.isdigit() else None   # cgroup v2 writes "max" for no limit
    except OSError:
        return None


def _stat(path: str, key: str) -> int:
    """One counter of a cgroup's memory.stat (0 when absent)."""
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def _cgroup_dirs(proc_self_cgroup: str, mount: str, v2: bool) -> list[str]:
    """This process's memory cgroup directory and its ancestors up to the mount, deepest first. Slurm and systemd
    put a job in a sub-cgroup with its own limit (its path is in /proc/self/cgroup); inside a container with a cgroup
    namespace the path is "/" and the mount itself is the job's cgroup."""
    path = "/"
    try:
        with open(proc_self_cgroup) as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and ((v2 and parts[0] == "0" and parts[1] == "")
                                        or (not v2 and "memory" in parts[1].split(","))):
                    path = parts[2] or "/"
    except OSError:
        pass
    if ".." in path.split("/"):   # outside our cgroup namespace's root: the mount is what we can see
        path = "/"
    dirs, rel = [], path.strip("/")
    while True:
        d = os.path.join(mount, rel) if rel else mount
        if os.path.isdir(d):
            dirs.append(d)
        if not rel:
            return dirs
        rel = os.path.dirname(rel)


def host_available_bytes(proc: str = "/proc", cgroup_mount: str = "/sys/fs/cgroup") -> int | None:
    """MemAvailable, or less where this process's memory cgroup (v2, else v1) or one above it leaves less before
    its limit: under Kubernetes or Slurm the host's figure is not what the job may use. `proc`/`cgroup_mount`: tests."""
    avail = None
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    v2 = os.path.exists(os.path.join(cgroup_mount, "cgroup.controllers"))
    mount = cgroup_mount if v2 else os.path.join(cgroup_mount, "memory")
    limit, usage = ("memory.max", "memory.current") if v2 else ("memory.limit_in_bytes", "memory.usage_in_bytes")
    for d in _cgroup_dirs(os.path.join(proc, "self", "cgroup"), mount, v2):
        cap, used = _read_int(os.path.join(d, limit)), _read_int(os.path.join(d, usage))
        if cap is not None and used is not None and cap < 2**60:   # v1 writes a huge number for no limit
            # the cgroup's usage counts page cache that the kernel reclaims before the limit bites (MemAvailable
            # counts it as free): the working set is usage - inactive_file, as the kubelet computes it
            room = max(0, cap - used + _stat(os.path.join(d, "memory.stat"),
                                             "inactive_file" if v2 else "total_inactive_file"))
            avail = room if avail is None else min(avail, room)
    return avail


def _pinned_size(nbytes: int) -> int:
    """torch's pinned host allocator hands out power-of-two blocks."""
    return 1 << max(0, nbytes - 1).bit_length()


def shadow_bytes(entries) -> int:
    """Host bytes of the shadows of `entries`: fp32 master and moments, and the low-precision out buffer (pinned
    like the live one, so rounded as the pinned allocator rounds it)."""
    total = 0
    for e in entries:
        out = e.out_buf.numel() * e.out_buf.element_size()
        total += e.master.numel() * 12 + (_pinned_size(out) if e.out_buf.is_pinned() else out)
    return total


def shadow_budget(entries, local_world: int, pending_bytes: int = 0) -> int:
    """Host bytes this rank's shadows may take: an equal share of half of the memory available (all they need when
    the host does not say), after `pending_bytes` per rank that are not allocated yet (the Adam moments, created at
    the first step). The shadows then cover the chunks whose gradients land first (the last units)."""
    need, avail = shadow_bytes(entries), host_available_bytes()
    if avail is None:
        return need
    free = max(0, avail - pending_bytes * max(1, local_world))
    return min(need, free // 2 // max(1, local_world))


TRIM_AFTER = 5   # committed steps watched before the shadows the worker never reached are released


def default_spec_threads(threads: int) -> int:
    """Threads of the speculative step: a quarter of the cores (and one more) stay with backward. Its autograd
    thread launches the kernels and the D2H copies; with 15 of 16 cores stepping, backward ran 40 ms longer per
    step on one H100 (0.89 B, BENCHMARKS.md S9), more than the speculation saved."""
    return max(1, threads - max(1, threads // 4) - 1)


@torch.no_grad()
def _swap_storage(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the data of two same-shaped contiguous tensors without copying (both objects keep their identity,
    so every holder of the live tensor sees the committed values)."""
    sa, oa = a.untyped_storage(), a.storage_offset()
    a.set_(b.untyped_storage(), b.storage_offset(), b.size(), b.stride())
    b.set_(sa, oa, a.size(), a.stride())


class Speculator:
    """Shadow buffers and the worker thread of one OffloadGradPath (see the module docstring). The path calls:
    submit(chunks) as chunks' D2H are queued during backward, end_of_backward(), then at step() claim(commit) on
    the main thread and collect() where the chunks are stepped; discard() when no step follows (skipped step,
    zero_grad, a checkpoint load)."""

    def __init__(self, chunks, optimizer, *, max_norm: float, threads: int, device=None,
                 budget_bytes: int | None = None, spec_threads: int | None = None, after_clip: bool = True):
        """chunks: the CPU-stepped chunks in forward order. Shadows are allocated for the chunks whose gradients land
        first in backward (the last ones), as many as `budget_bytes` allows (all when None)."""
        self.optimizer = optimizer
        self.bound = float(max_norm) ** 2 if max_norm > 0 else None
        self.threads = spec_threads or default_spec_threads(threads)
        self.after_clip = after_clip    # False: a backward right after a clipped step is not speculated
        self.last_clipped = False       # the last step's factor was below 1.0 (note_factor)
        self.device = device
        covered, used = [], 0
        for c in reversed(chunks):
            size = shadow_bytes(c.entries)
            if budget_bytes is not None and used + size > budget_bytes:
                break
            covered.append(c)
            used += size
        self.covered = {id(c) for c in covered}   # the chunks that are speculated
        self.shadow_used_bytes = used
        self._covered_chunks = {id(c): c for c in covered}
        self._reached: set[int] = set()      # covered chunks the worker stepped in the steps watched so far
        self._watched = 0                    # committed steps watched (trim_unreached)
        with torch.no_grad():   # written now (zeros): a page's first touch otherwise fell in the first steps that
            # reached it, inside a timed step (0.4 s per GiB measured; slowest of all on a freshly started host)
            self.shadow = {id(e.master): (torch.zeros_like(e.master), torch.zeros_like(e.master),
                                          torch.zeros_like(e.master),
                                          torch.empty_like(e.out_buf, pin_memory=e.out_buf.is_pinned()).zero_())
                           for c in covered for e in c.entries}
        # steps committed / dropped / whose speculation stopped on the partial norm; entries committed
        self.stats = {"committed": 0, "dropped": 0, "stopped_early": 0, "entries_committed": 0,
                      "skipped_after_clip": 0}
        self.last = None             # this step's outcome: "committed", "dropped" or None (not speculated)
        self.last_trace: list[tuple[float, float, float, int]] = []   # the last collected backward's chunks:
        # (start, grads landed, stepped, numel). The lock: with overlap, collect() resets on the step's worker while
        # the main thread's zero_grad() may call discard(); each must see the other's state change whole
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        """(Under self._lock once the worker exists.)"""
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._claimed = False
        self._commit = False
        self._done: dict[int, tuple[frozenset, dict]] = {}   # chunk -> (entry names stepped, their hyperparameters)
        self._hyper: dict[int, dict] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._trace: list[tuple[float, float, float, int]] = []   # perf_counter times (the offload timeline)

    @property
    def active(self) -> bool:
        return self._thread is not None

    # -- during backward -----------------------------------------------------------------------------------------
    def submit(self, chunks) -> None:
        chunks = [c for c in chunks if id(c) in self.covered]
        if not chunks or (self.last_clipped and not self.after_clip):
            return
        if self._thread is None:      # the first unit of this backward: snapshot the groups (the scheduler has
            self._hyper = {id(m): {k: v for k, v in g.items() if k != "params"}   # already moved to this step)
                           for g in self.optimizer.param_groups for m in g["params"]}
            self._queue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._main, daemon=True, name="fsdpzero-offload-speculate")
            self._thread.start()
        for c in chunks:   # which entries have grads, read now: zero_grad() may drop them before the worker runs
            self._queue.put((c, [e for e in c.entries if e.param.grad is not None]))

    def end_of_backward(self) -> None:
        if self._queue is not None:
            self._queue.put(None)

    @torch.no_grad()   # grad mode is per thread
    def _main(self) -> None:
        from fsdpzero_ops import cpu_adam
        try:
            if self.device is not None:
                torch.cuda.set_device(self.device)
            torch.set_num_threads(self.threads)
            sumsq = 0.0
            while (job := self._queue.get()) is not None:
                chunk, items = job
                if self._cancel.is_set() or self._stopped:
                    continue
                t0 = time.perf_counter()
                if chunk.d2h_done is not None:
                    chunk.d2h_done.synchronize()
                t1 = time.perf_counter()
                if self.bound is not None:
                    sumsq += sum(cpu_adam.grad_sumsq(e.grad_buf, self.optimizer.build) for e in items)
                    if sumsq > self.bound * (1 + 1e-3):   # margin: this sum and the engine's round differently
                        self._stopped = True
                        continue
                for e in items:
                    self.optimizer.step_param(e.master, e.grad_buf, out=self.shadow[id(e.master)][3],
                                              hyper=self._hyper[id(e.master)], into=self.shadow[id(e.master)][:3])
                self._done[id(chunk)] = (frozenset(e.name for e in items),
                                         {id(e.master): self._hyper[id(e.master)] for e in items})
                self._trace.append((t0, t1, time.perf_counter(), sum(e.master.numel() for e in items)))
        except BaseException as err:   # reported by collect(); the step then runs without speculation
            self._error = err

    # -- at the step ---------------------------------------------------------------------------------------------
    def note_factor(self, factor: float) -> None:
        """(Main thread, in step()) this step's clip factor, known now: below 1.0, the next backward is likely to
        clip too (see the module docstring)."""
        if self.last_clipped and not self.after_clip:
            self.stats["skipped_after_clip"] += 1   # this backward was not speculated
        self.last_clipped = factor < 1.0

    def drain(self) -> None:
        """Wait until every submitted chunk has been speculated (after end_of_backward; tests use it to make the
        outcome independent of timing)."""
        if self._thread is not None:
            self._thread.join()

    def claim(self, commit: bool) -> None:
        """(Main thread, in step()) the step will use this speculation: commit it if `commit`, else drop it.
        Either way the worker takes no further chunk: once the factor is known, the step itself steps what is
        left, in place and in forward order, so the next forward's first units are ready first (the worker
        goes in the order the grads landed, the reverse)."""
        self._claimed, self._commit = True, commit
        self._cancel.set()

    def collect(self, hyper_now: dict[int, dict]) -> dict[int, frozenset]:
        """Wait for the worker; per chunk id, the names of the entries whose speculative step is to be committed
        (their hyperparameters unchanged since backward). Empty when dropped."""
        with self._lock:
            thread = self._thread
            if thread is None:
                self.last, self.last_trace = None, []
                return {}
            self.end_of_backward()   # normally queued already by finish_gradients; a second end marker is harmless
        thread.join()
        with self._lock:
            commit, done, err, stopped = self._commit and self._error is None, self._done, self._error, self._stopped
            self.last_trace = self._trace
            self._reset()
            if commit and not stopped:
                self._trim_unreached(done)
        if err is not None:
            log.warning("offload: the speculative CPU step failed (%r); stepping without it", err)
        if stopped:
            self.stats["stopped_early"] += 1
        if not commit:
            self.stats["dropped"] += 1
            self.last = "dropped"
            return {}
        self.stats["committed"] += 1
        self.last = "committed"
        return {k: names for k, (names, hyper) in done.items()
                if all(hyper_now.get(m) == h for m, h in hyper.items())}

    def _trim_unreached(self, done) -> None:
        """After TRIM_AFTER committed steps, release the shadows of the covered chunks the worker never reached
        before the step claimed it: their memory would sit idle (how far the CPU gets during backward depends on
        the host and the model, so the budget covers more at first)."""
        if self._watched >= TRIM_AFTER:
            return
        self._reached.update(done)
        self._watched += 1
        if self._watched < TRIM_AFTER:
            return
        idle = [c for k, c in self._covered_chunks.items() if k not in self._reached]
        if not idle:
            return
        freed = shadow_bytes([e for c in idle for e in c.entries])
        released = []
        for c in idle:
            self.covered.discard(id(c))
            for e in c.entries:
                released.append(self.shadow.pop(id(e.master)))
        # freed by another thread: unmapping GiBs here (0.08 s per GiB measured) would stall this step
        threading.Thread(target=released.clear, name="fsdpzero-offload-release", daemon=True).start()
        self.shadow_used_bytes -= freed
        log.info("offload: speculation reached %d of %d shadowed chunks in %d steps; the shadows of the other %d "
                 "released (%.2f GiB)", len(self.covered), len(self._covered_chunks), TRIM_AFTER, len(idle),
                 freed / 2**30)

    @torch.no_grad()
    def commit(self, entry) -> None:
        """The entry's speculative step becomes its state: live <-> shadow (master, moments, out buffer)."""
        state = self.optimizer.state_for(entry.master)
        shadow = self.shadow[id(entry.master)]
        for live, spec in zip((entry.master, state["exp_avg"], state["exp_avg_sq"], entry.out_buf), shadow):
            _swap_storage(live, spec)
        state["step"] += 1
        self.stats["entries_committed"] += 1

    def discard(self) -> None:
        """No step will use this backward's speculation (skipped step, zero_grad, a load): stop and forget it."""
        with self._lock:
            if self._thread is None or self._claimed:
                return
            self._cancel.set()
            self.end_of_backward()
            self._thread.join()
            self._reset()
            self.stats["dropped"] += 1
            self.last, self.last_trace = "dropped", []
