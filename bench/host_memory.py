"""Host memory of a training process, measured and capped, for bench/nvme_budget.py: /proc/self/status fields,
torch's pinned allocator, bytes on disk, a checkpoint round trip with its own peaks, and a cgroup v2 child with
memory.max where the host lets us create one."""
from __future__ import annotations

import os
import time
from pathlib import Path

import torch

GIB = 2**30


# ---------------------------------------------------------------- measurement
def proc_status() -> dict:
    """VmHWM / VmRSS / RssAnon / RssFile / RssShmem of this process, GiB (Linux)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, val = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem", "VmLck", "VmPin"):
            out[key] = int(val.split()[0]) * 1024 / GIB
    return out


def pinned_gib() -> dict:
    """torch's pinned host allocator (CUDA): bytes it holds now (in use + cached) and at peak."""
    if not torch.cuda.is_available():
        return {}
    try:
        s = torch.cuda.host_memory_stats()
    except (AttributeError, RuntimeError):
        return {}
    return {f"pinned_{k.replace('.', '_')}_gib": v / GIB for k, v in s.items()
            if k in ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current")}


def disk_bytes(path: Path) -> int:
    """Bytes allocated on disk under path (st_blocks, so sparse files count what they use)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return total


def checkpoint_round_trip(engine, save_dir: Path, mem: dict) -> dict:
    """engine.save_checkpoint then engine.load_checkpoint (DeepSpeed's signatures, both implementations), the peak
    RSS of each measured alone: VmHWM is reset through /proc/self/clear_refs before each."""
    import torch.distributed as dist
    out = {}
    for what in ("save", "load"):
        Path("/proc/self/clear_refs").write_text("5")        # VmHWM := VmRSS
        dist.barrier()
        t0 = time.perf_counter()
        if what == "save":
            engine.save_checkpoint(str(save_dir), tag="bench")
        else:
            engine.load_checkpoint(str(save_dir), tag="bench")
        dist.barrier()
        mem[what] = proc_status()
        out[f"{what}_s"] = time.perf_counter() - t0
    out["checkpoint_disk_gib"] = disk_bytes(save_dir) / GIB
    return out


# ---------------------------------------------------------------- the hard budget: a cgroup v2 child, if allowed
def make_cgroup(limit: int, tag: str) -> tuple[Path | None, str]:
    """A child of this process's cgroup v2 with memory.max = limit, or (None, why not)."""
    root = Path("/sys/fs/cgroup")
    if not (root / "cgroup.controllers").exists():
        return None, "no cgroup v2 hierarchy at /sys/fs/cgroup"
    try:
        rel = next(line[3:].strip() for line in Path("/proc/self/cgroup").read_text().splitlines()
                   if line.startswith("0::"))
        here = root / rel.lstrip("/")
        if "memory" not in (here / "cgroup.subtree_control").read_text().split():
            (here / "cgroup.subtree_control").write_text("+memory")   # EBUSY while `here` holds processes
        child = here / f"fsdpzero_budget.{os.getpid()}.{tag}"
        child.mkdir()
    except (OSError, StopIteration) as e:
        return None, f"cgroup v2 not writable here ({e})"
    try:
        (child / "memory.max").write_text(str(limit))
        if (child / "memory.swap.max").exists():
            (child / "memory.swap.max").write_text("0")
    except OSError as e:
        child.rmdir()
        return None, f"cgroup v2 memory.max not settable ({e})"
    return child, f"cgroup v2 {child} memory.max={limit / GIB:.2f} GiB (all ranks + torchrun agent)"


def cgroup_events(child: Path) -> dict:
    out = {}
    for name in ("memory.peak", "memory.events"):
        try:
            text = (child / name).read_text()
        except OSError:
            continue
        if name == "memory.peak":
            out["cgroup_memory_peak_gib"] = int(text) / GIB
        else:
            out["cgroup_oom_kill"] = int(dict(line.split() for line in text.splitlines()).get("oom_kill", 0))
    return out
