"""`fsdpzero nvme-bench PATH`: sweep block size, queue depth and parallelism of the aio engine on the disk that
holds PATH, print read/write GB/s per setting and the best `aio` section to paste into ds_config.json.

Each measurement moves one `--size` buffer (page-aligned, pinned when a GPU exists) to or from one O_DIRECT file
in one request, as a swap of one optimizer sub-group does; the file is written once before timing so that block
allocation is not measured.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import stat
import tempfile
import time
from pathlib import Path

import torch

from .aio import ALIGN, BACKENDS, AioConfig, AioFile, AioHandle, aligned_empty, available_backends, open_file


# The bounds the config layer puts on the `aio` section (fsdpzero/config/bounds.py; ops never import the library, a
# test keeps the two equal), and a cap on the one buffer the sweep allocates.
MAX_BLOCK_SIZE = 2**30
MAX_QUEUE_DEPTH = 1024
MAX_INTRA_OP_PARALLELISM = 256
MAX_REQUEST = 16 * 2**30


def _size(part: str, hi: int) -> int:
    units = {"k": 2**10, "m": 2**20, "g": 2**30}
    text = part.strip().lower().rstrip("b").rstrip("i")
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{part.strip()!r} is not a size (bytes, or with K/M/G: 256K, 1M)") from None
    if not (ALIGN <= value <= hi) or value % ALIGN:
        raise argparse.ArgumentTypeError(f"{part.strip()!r}: must be a multiple of {ALIGN} bytes (O_DIRECT) "
                                         f"between 4K and {hi >> 30}G")
    return int(value)


def request_size(text: str) -> int:
    return _size(text, MAX_REQUEST)


def block_sizes(text: str) -> list[int]:
    return [_size(part, MAX_BLOCK_SIZE) for part in text.split(",")]


def _ints(text: str, hi: int) -> list[int]:
    out = []
    for part in text.split(","):
        try:
            value = int(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not an integer") from None
        if not 1 <= value <= hi:
            raise argparse.ArgumentTypeError(f"{value}: must be between 1 and {hi}")
        out.append(value)
    return out


def queue_depths(text: str) -> list[int]:
    return _ints(text, MAX_QUEUE_DEPTH)


def parallelism(text: str) -> list[int]:
    return _ints(text, MAX_INTRA_OP_PARALLELISM)


def repeats(text: str) -> int:
    values = _ints(text, 1000)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"{text!r}: one integer")
    return values[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a directory on the disk to test (a scratch file is created and removed)")
    parser.add_argument("--size", type=request_size, default="256M", help="bytes per request (default 256M)")
    parser.add_argument("--block-sizes", type=block_sizes, default="256K,1M,4M", help="aio.block_size values")
    parser.add_argument("--queue-depths", type=queue_depths, default="4,8,32", help="aio.queue_depth values")
    parser.add_argument("--parallelism", type=parallelism, default="1,2,4", help="aio.intra_op_parallelism values")
    parser.add_argument("--submit-modes", action="store_true",
                        help="also sweep single_submit and overlap_events (4x the settings)")
    parser.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                        help=f"one of {available_backends()} or auto")
    parser.add_argument("--repeat", type=repeats, default=2, help="timed repetitions per setting; the best counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")


def measure(handle: AioHandle, buf: torch.Tensor, f: AioFile | Path, repeat: int = 2) -> tuple[float, float]:
    """(write GB/s, read GB/s), best of `repeat`, for one request of buf's size on the open O_DIRECT file `f` (or
    the file at a path, opened for the measurement: bench/nvme.py)."""
    if not isinstance(f, AioFile):
        with handle.open(f, write=True) as opened:
            return measure(handle, buf, opened, repeat)
    nbytes = buf.numel() * buf.element_size()
    best_w = best_r = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        handle.pwrite(buf, f).wait()
        best_w = min(best_w, time.perf_counter() - t0)
        t0 = time.perf_counter()
        handle.pread(buf, f).wait()
        best_r = min(best_r, time.perf_counter() - t0)
    return nbytes / best_w / 1e9, nbytes / best_r / 1e9


def _private_dir(path: Path) -> tuple[Path, int]:
    """A fresh 0700 directory under `path` and a descriptor of it, checked through the descriptor: a real directory
    (O_NOFOLLOW), this user's, open to nobody else. In a shared `path` another user could rename the directory
    mkdtemp made and put a link or a directory of theirs in its place; everything after this goes through the
    descriptor, so that cannot redirect the scratch file."""
    private = Path(tempfile.mkdtemp(prefix=".fsdpzero_nvme_bench.", dir=path))
    try:
        fd = os.open(private, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise ValueError(f"{private}, made a moment ago, is now a symbolic link or not a directory: another user "
                         f"of {path} replaced it; pass a directory of your own") from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        os.close(fd)
        raise ValueError(f"{private}, made a moment ago, now belongs to uid {st.st_uid} with mode "
                         f"{stat.S_IMODE(st.st_mode):o}: another user of {path} replaced it; pass a directory of "
                         f"your own")
    return private, fd


def sweep(path: Path, size: int, block_sizes, queue_depths, parallelism, submit_modes=((False, True),),
          backend="auto", repeat=2) -> list[dict]:
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} is not a directory; pass a directory on the disk to test")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"cannot create {path} ({e.strerror or e}); pass a writable directory on the disk to "
                         "test") from None
    try:   # a private (0700) directory of its own, held open, and the scratch file created in it exclusively and
        # relative to it: neither a name planted in a shared directory (a symlink to someone's file) nor a directory
        # swapped in for ours is ever written through
        private, private_fd = _private_dir(path)
    except OSError as e:
        raise ValueError(f"cannot write a scratch file in {path} ({e.strerror or e}); pass a writable "
                         "directory on the disk to test") from None
    buf = aligned_empty(size)
    buf.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8))
    results = []
    try:
        try:
            f = open_file(private / "scratch.bin", write=True, exclusive=True, dir_fd=private_fd)
        except OSError as e:          # a read-only mount, no permission, a full disk: say so, not errno alone
            raise ValueError(f"cannot write a scratch file in {path} ({e.strerror or e}); pass a writable "
                             "directory on the disk to test") from None
        configs = [AioConfig(block_size=bs, queue_depth=qd, intra_op_parallelism=par, single_submit=single,
                             overlap_events=overlap)
                   for bs, qd, par, (single, overlap) in itertools.product(block_sizes, queue_depths, parallelism,
                                                                           submit_modes)]
        with f:   # one file, opened once, for the whole sweep
            try:
                with AioHandle(configs[0], backend) as h:
                    h.pwrite(buf, f).wait()                      # allocate the file's blocks before timing
            except OSError as e:
                raise ValueError(f"cannot write a scratch file in {path} ({e.strerror or e}); pass a writable "
                                 "directory on the disk to test") from None
            for cfg in configs:
                with AioHandle(cfg, backend) as h:
                    w, r = measure(h, buf, f, repeat)
                    results.append({"aio": {k: getattr(cfg, k) for k in AioConfig.__dataclass_fields__},
                                    "backend": h.backend, "write_GBps": round(w, 3), "read_GBps": round(r, 3)})
    finally:
        try:
            os.unlink("scratch.bin", dir_fd=private_fd)
        except FileNotFoundError:
            pass
        try:   # the directory itself only if it is still the one made (not a replacement put at its name)
            if os.path.samestat(os.lstat(private), os.fstat(private_fd)):
                private.rmdir()
        except OSError:
            pass
        os.close(private_fd)
    return results


def best(results: list[dict]) -> dict:
    """The setting with the shortest write + read time: a swap moves as many bytes out as in."""
    return min(results, key=lambda r: 1 / r["write_GBps"] + 1 / r["read_GBps"])


def run(args) -> int:
    modes = list(itertools.product((False, True), (False, True))) if args.submit_modes else [(False, True)]
    results = sweep(Path(args.path), args.size, args.block_sizes, args.queue_depths, args.parallelism,
                    modes, args.backend, args.repeat)
    top = best(results)
    if args.json:
        print(json.dumps({"path": str(args.path), "size": args.size, "results": results, "best": top}))
        return 0
    print(f"{'backend':<9} {'block_size':>10} {'queue_depth':>11} {'parallelism':>11} {'single':>6} "
          f"{'overlap':>7} {'write GB/s':>10} {'read GB/s':>9}")
    for r in results:
        a = r["aio"]
        print(f"{r['backend']:<9} {a['block_size']:>10} {a['queue_depth']:>11} {a['intra_op_parallelism']:>11} "
              f"{str(a['single_submit']):>6} {str(a['overlap_events']):>7} {r['write_GBps']:>10.2f} "
              f"{r['read_GBps']:>9.2f}")
    print(f"\nbest (write {top['write_GBps']:.2f} GB/s, read {top['read_GBps']:.2f} GB/s, backend {top['backend']}); "
          "paste into ds_config.json:")
    print(json.dumps({"aio": top["aio"]}, indent=2))
    return 0
