"""Swap directories for NVMe offload: <nvme_path>/fsdpzero_swap/<host>.<pid>.<n>.rank<r>/, one per optimizer.

Each is made by this process with mode 0700 (an exclusive mkdir: a name someone planted, a link included, is never
used) and its files are created with O_EXCL | O_NOFOLLOW (fsdpzero.ops.aio.open_file(exclusive=True)).

Created at start with a marker naming the owning process (pid, its start time, the boot id) and saying it is not a
checkpoint; free space and writability are checked before anything is written; removed on close, at exit and on
garbage collection; one left by a killed process (dead pid, reused pid, another boot) is removed by the next start
on the same host. Other hosts' directories are never touched: their processes cannot be checked from here.
"""
from __future__ import annotations

import errno
import itertools
import json
import os
import shutil
import socket
import weakref
from pathlib import Path

from fsdpzero.ops.aio import ALIGN, AioConfig, AioHandle, aligned_empty

SWAP_ROOT = "fsdpzero_swap"
MARKER = "FSDPZERO_SWAP_NOT_A_CHECKPOINT.json"
_instances = itertools.count()


def _proc_start_time(pid: int) -> str | None:
    """Start time of a live process (field 22 of /proc/<pid>/stat), None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def is_swap_dir(path) -> bool:
    """True for a directory made by SwapDir (checkpoint loaders should refuse these)."""
    path = Path(path)
    return path.name == SWAP_ROOT or (path / MARKER).exists() or (path.parent.name == SWAP_ROOT)


def remove_stale_swap_dirs(nvme_path) -> list[Path]:
    """Remove swap directories under nvme_path left by dead processes of this host (killed runs). Returns them."""
    base, host, removed = Path(nvme_path) / SWAP_ROOT, socket.gethostname(), []
    if base.is_symlink() or not base.is_dir():   # a link: not ours to look into
        return removed
    for d in base.iterdir():
        if d.is_symlink():
            continue
        try:
            owner_host, pid, _, _ = d.name.rsplit(".", 3)
            pid = int(pid)
        except ValueError:
            continue                       # not ours: leave it alone
        if owner_host != host:
            continue                       # another node's process: we cannot tell whether it is alive
        try:
            marker = json.loads((d / MARKER).read_text())
        except (OSError, ValueError):
            marker = {}
        alive = (_proc_start_time(pid) is not None and marker.get("boot_id", _boot_id()) == _boot_id()
                 and marker.get("start_time", _proc_start_time(pid)) == _proc_start_time(pid))
        if not alive:
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    if removed:
        try:
            base.rmdir()                       # only if no live directory remains
        except OSError:
            pass
    return removed


def _private_dir(base: Path, rank: int) -> Path:
    """base/<host>.<pid>.<n>.rank<r>, made by this call with mode 0700 (mkdir is exclusive): never a directory or
    link someone else planted under that predictable name (a taken name moves on to the next n). `base` itself,
    shared by the ranks and the users of the disk, must be a real directory, not a link to somewhere else."""
    for _ in range(1000):
        try:
            base.mkdir(exist_ok=True)   # again each time: another rank may just have removed it
        except FileExistsError:
            pass
        if base.is_symlink() or not base.is_dir():
            raise OSError(errno.ELOOP, f"{base} is a symbolic link or not a directory; the swap space is made only "
                          f"in a real directory (remove it)", str(base))
        path = base / f"{socket.gethostname()}.{os.getpid()}.{next(_instances)}.rank{rank}"
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            continue
        except FileNotFoundError:   # base removed by another rank between the two calls
            continue
        return path
    raise FileExistsError(errno.EEXIST, f"no free swap directory name under {base}", str(base))


class SwapDir:
    """This process's swap directory under nvme_path; `key` names the config key in error messages."""

    def __init__(self, nvme_path, rank: int = 0, key: str = "offload_optimizer.nvme_path"):
        if nvme_path is None:
            raise ValueError(f"config key '{key}' is not set: NVMe offload needs a directory on a fast local disk, "
                             f"e.g. \"{key.rsplit('.', 1)[-1]}\": \"/local_nvme\"")
        self.key, self.root = key, Path(nvme_path)
        try:
            if not self.root.exists():
                raise FileNotFoundError(errno.ENOENT, f"config key '{key}' = {str(self.root)!r}: the directory "
                                        "does not exist; create it (mkdir -p) or point it at a directory on the "
                                        "NVMe disk", str(self.root))
            if not self.root.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"config key '{key}' = {str(self.root)!r} is not a "
                                         "directory", str(self.root))
            base = self.root / SWAP_ROOT
            remove_stale_swap_dirs(self.root)
            self.path = _private_dir(base, rank)
            (self.path / MARKER).write_text(json.dumps(
                {"what": "fsdpzero NVMe swap space (optimizer states of a running job); not a checkpoint",
                 "pid": os.getpid(), "start_time": _proc_start_time(os.getpid()), "boot_id": _boot_id(),
                 "rank": rank}))
        except PermissionError:
            raise PermissionError(errno.EACCES, f"config key '{key}' = {str(self.root)!r}: not writable (or not "
                                  f"reachable) by this user (uid {os.getuid()}); fix its permissions or choose "
                                  "another directory", str(self.root)) from None
        except OSError as e:            # a read-only mount (EROFS), /proc, ...: name the key, not just the errno
            if f"config key '{key}'" in str(e.strerror):
                raise
            raise OSError(e.errno, f"config key '{key}' = {str(self.root)!r}: cannot create swap space there "
                          f"({e.strerror or e}); point it at a writable directory on the NVMe disk",
                          str(self.root)) from None
        self._finalizer = weakref.finalize(self, _remove_swap_dir, self.path)

    def check_space(self, nbytes: int) -> None:
        """Fail now, not mid-step: the file system must take an O_DIRECT write and have `nbytes` free."""
        probe = self.path / ".write_probe"
        try:
            with AioHandle(AioConfig(block_size=ALIGN), backend="python") as h, \
                    h.open(probe, write=True, exclusive=True) as f:
                h.pwrite(aligned_empty(ALIGN), f).wait()
                os.fsync(f.fd)
        except OSError as e:
            raise OSError(e.errno, f"config key '{self.key}' = {str(self.root)!r}: cannot write swap files in "
                          f"{self.path}: {e.strerror or e}") from None
        finally:
            probe.unlink(missing_ok=True)
        free = shutil.disk_usage(self.path).free
        if free < nbytes:
            raise OSError(errno.ENOSPC, f"config key '{self.key}' = {str(self.root)!r}: NVMe offload of this rank "
                          f"needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of swap space, the file system has "
                          f"{free} bytes ({free / 2**30:.2f} GiB) free; free space, use a bigger disk, or offload "
                          "to \"cpu\"")

    def close(self) -> None:
        self._finalizer()


def _remove_swap_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    try:
        path.parent.rmdir()               # the fsdpzero_swap folder too, once no rank uses it
    except OSError:
        pass


def close_swap_io(handles, file, swap_dir) -> None:
    """Close an owner's aio handles, its swap file and its swap directory (pending write errors are moot at
    teardown). The owner drops its references first, so each is closed at most once. Shared by the NVMe optimizer
    and the parameter swapper."""
    for handle in handles:
        if handle is not None:
            try:
                handle.close()
            except OSError:
                pass
    if file is not None:
        file.close()
    if swap_dir is not None:
        swap_dir.close()
