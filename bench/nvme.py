"""NVMe swap bandwidth: our aio engine vs the raw disk (`dd` with O_DIRECT, and fio when installed) on the same
file system, in one run. Prints a table and writes JSON.

    python bench/nvme.py --dir /local_nvme/tmp --size 1G --json out/nvme.json

Every tool moves the same bytes between one pre-allocated file and memory with O_DIRECT (no fsync: O_DIRECT data
has left the page cache when the call returns, for all of them). "raw" is the best of dd and fio; the target is
ours >= 0.9 x raw for both reads and writes. Timings alternate between tools and repeat (best of --repeat), so a
disk whose speed drifts (throttled cloud disks) hurts every tool alike.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import fsdpzero.ops  # noqa: E402,F401  registers fsdpzero_ops from the source tree
from fsdpzero_ops.aio import AioConfig, AioHandle, aligned_empty  # noqa: E402
from fsdpzero_ops.aio_bench import _sizes, measure  # noqa: E402


def dd(path: Path, size: int, bs: int, write: bool) -> float:
    """GB/s of one dd pass with O_DIRECT (conv=notrunc: the file stays allocated, as ours does)."""
    count = size // bs
    cmd = (["dd", "if=/dev/zero", f"of={path}", f"bs={bs}", f"count={count}", "oflag=direct", "conv=notrunc"]
           if write else ["dd", f"if={path}", "of=/dev/null", f"bs={bs}", f"count={count}", "iflag=direct"])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    seconds = float(re.search(r"copied, ([\d.e+-]+) s", out).group(1))
    return count * bs / seconds / 1e9


def fio(path: Path, size: int, bs: int, depth: int, write: bool) -> float:
    """GB/s of one fio job (io_uring engine, O_DIRECT, `depth` in flight)."""
    cmd = ["fio", "--name=fsdpzero", f"--filename={path}", f"--rw={'write' if write else 'read'}", f"--bs={bs}",
           f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1", f"--size={size}", "--output-format=json"]
    job = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)["jobs"][0]
    return job["write" if write else "read"]["bw_bytes"] / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/tmp", help="directory on the disk under test")
    ap.add_argument("--size", default="1G")
    ap.add_argument("--block-size", default="4M", help="our aio.block_size, dd's bs and fio's bs")
    ap.add_argument("--queue-depth", type=int, default=8)
    ap.add_argument("--parallelism", type=int, default=2)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    size, bs = _sizes(args.size)[0], _sizes(args.block_size)[0]
    size -= size % bs
    path = Path(args.dir) / f".fsdpzero_nvme_bench.{os.getpid()}.bin"
    cfg = AioConfig(block_size=bs, queue_depth=args.queue_depth, intra_op_parallelism=args.parallelism)
    buf = aligned_empty(size)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    rows: dict[str, list[float]] = {}
    try:
        with AioHandle(cfg, args.backend) as h:
            backend = h.backend
            with h.open(path, write=True) as f:
                h.pwrite(buf, f).wait()                      # allocate the blocks once, for every tool
            tools = {f"ours ({backend})": lambda: measure(h, buf, path, repeat=1)}
            for dbs in sorted({bs, 2**20}):
                tools[f"dd bs={dbs >> 20}M"] = lambda dbs=dbs: (dd(path, size, dbs, True), dd(path, size, dbs, False))
            if shutil.which("fio"):
                for depth in sorted({1, args.queue_depth * args.parallelism}):
                    tools[f"fio io_uring qd={depth}"] = lambda d=depth: (fio(path, size, bs, d, True),
                                                                         fio(path, size, bs, d, False))
            names = list(tools)
            for rep in range(args.repeat):                  # rotate the order: no tool always runs first
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    w, r = tools[name]()
                    prev = rows.get(name, [0.0, 0.0])
                    rows[name] = [max(prev[0], w), max(prev[1], r)]
    finally:
        path.unlink(missing_ok=True)

    ours_key = names[0]
    raw_w = max(v[0] for k, v in rows.items() if k != ours_key)
    raw_r = max(v[1] for k, v in rows.items() if k != ours_key)
    ours_w, ours_r = rows[ours_key]
    print(f"{args.size} per pass, block {bs >> 20} MiB, best of {args.repeat}, dir {args.dir}")
    print(f"{'tool':<22} {'write GB/s':>10} {'read GB/s':>9}")
    for k, (w, r) in rows.items():
        print(f"{k:<22} {w:>10.2f} {r:>9.2f}")
    print(f"{'ours / raw':<22} {ours_w / raw_w:>10.2f} {ours_r / raw_r:>9.2f}   (target >= 0.90)")
    result = {"dir": args.dir, "size": size, "aio": {k: getattr(cfg, k) for k in AioConfig.__dataclass_fields__},
              "backend": backend, "GBps": {k: {"write": round(w, 3), "read": round(r, 3)} for k, (w, r) in rows.items()},
              "ratio": {"write": round(ours_w / raw_w, 3), "read": round(ours_r / raw_r, 3)}}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
