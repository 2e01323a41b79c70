"""Save-time cost of the manifest's CRC-32 checksums (fsdpzero.checkpoint.trust.ChecksumWriter), one process:
a ~100 MiB state saved with torch's FileSystemWriter, with ChecksumWriter, and through fsdpzero's whole
save_checkpoint (JSON, RNG, manifest, rename, `latest`), alternated, 5 runs each; then one load and its
checksum verification.

    python bench/ckpt_checksum.py [DIR] [--threads 4] [--mib 100]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "ops"))   # fsdpzero_ops, from the checkout
from fsdpzero.checkpoint import dcp as ck  # noqa: E402
from fsdpzero.checkpoint.trust import ChecksumWriter  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")   # DCP warns that no process group exists: one process is the point here
    p = argparse.ArgumentParser()
    p.add_argument("dir", nargs="?", default=None)
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--mib", type=int, default=100)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="ckpt_crc_"))
    root.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    n = args.mib * 2**20 // 4 // 16
    state = {f"t{i}": torch.randn(n, generator=g) for i in range(16)}
    ways = {
        "torch FileSystemWriter": lambda d: dcp.save(state, no_dist=True, storage_writer=dcp.FileSystemWriter(
            d, sync_files=True, thread_count=args.threads)),
        "ChecksumWriter (CRC-32)": lambda d: dcp.save(state, no_dist=True, storage_writer=ChecksumWriter(
            d, sync_files=True, thread_count=args.threads)),
        "fsdpzero save_checkpoint": lambda d: ck.save_checkpoint(d, "t", {"s": state}),
    }
    times: dict[str, list[float]] = {k: [] for k in ways}
    for rep in range(args.repeats):
        for i, (name, fn) in enumerate(ways.items()):
            d = root / f"w{i}_{rep}"
            t0 = time.perf_counter()
            fn(d)
            times[name].append(time.perf_counter() - t0)
            shutil.rmtree(d)
    ck.save_checkpoint(root / "v", "t", {"s": state})
    t0 = time.perf_counter()
    ck.verify_checkpoint(root / "v" / "t", distributed=False)
    verify = time.perf_counter() - t0
    into = {"s": {k: torch.empty_like(v) for k, v in state.items()}}
    t0 = time.perf_counter()
    ck.load_checkpoint(root / "v", "t", into)
    load = time.perf_counter() - t0
    shutil.rmtree(root / "v")
    print(f"{args.mib} MiB, {args.threads} writer threads, {os.cpu_count()} CPUs, torch {torch.__version__}, "
          f"dir {root}; median (min) of {args.repeats}:")
    med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
    for k, v in times.items():
        print(f"  {k:26s} save {med[k] * 1e3:8.1f} ms ({min(v) * 1e3:.1f})")
    base, crc = med["torch FileSystemWriter"], med["ChecksumWriter (CRC-32)"]
    print(f"  CRC-32 overhead: {(crc - base) * 1e3:+.1f} ms ({100 * (crc / base - 1):+.1f}%)")
    print(f"  load {load * 1e3:.1f} ms, of which checksum verification {verify * 1e3:.1f} ms (one process)")
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
