"""Swap directories for NVMe offload: <nvme_path>/fsdpzero_swap-<uid>/<host>.<pid>.<n>.rank<r>/, one per optimizer.

The disk is often shared (a 1777 /local_nvme), and every name here is predictable, so nothing is trusted by name:
- `fsdpzero_swap-<uid>` is this user's own: made with mode 0700, and used only when it is a real directory owned by
  this user (euid) that nobody else can write (another user who made it first could swap the directories in it);
- each swap directory is made by this process with mode 0700 (an exclusive mkdir: a name someone planted, a link
  included, is never used), opened with O_DIRECTORY | O_NOFOLLOW and checked (owner, mode), and held open: its marker
  and swap files are created relative to that descriptor (dir_fd) with O_CREAT | O_EXCL | O_NOFOLLOW
  (fsdpzero_ops.aio.open_file(exclusive=True, dir_fd=...)), so a directory renamed or replaced on the way cannot
  redirect them;
- a stale directory's marker is read with O_NOFOLLOW, only when it is a regular file, at most MARKER_MAX bytes (a
  marker linked to /dev/zero, a FIFO or a huge file is no marker).

Created at start with a marker naming the owning process (pid, its start time, the boot id) and saying it is not a
checkpoint; free space and writability are checked before anything is written; removed on close, at exit and on
garbage collection; one left by a killed process (dead pid, reused pid, another boot) is removed by the next start
on the same host. Other hosts' directories are never touched: their processes cannot be checked from here.
"""
from __future__ import annotations

import dataclasses
import errno
import itertools
import json
import os
import shutil
import socket
import stat
import weakref
from pathlib import Path

from fsdpzero.plan.types import AioPlan
from fsdpzero_ops.aio import ALIGN, AioConfig, AioFile, AioHandle, aligned_empty, open_file

SWAP_ROOT_PREFIX = "fsdpzero_swap"
SWAP_ROOT = f"{SWAP_ROOT_PREFIX}-{os.geteuid()}"   # one per user: never shared with another user of the disk
MARKER = "FSDPZERO_SWAP_NOT_A_CHECKPOINT.json"
MARKER_MAX = 4096                                   # a marker is ~200 bytes of JSON
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_instances = itertools.count()


def aio_config(aio=None, **values) -> AioConfig:
    """The ops engine's parameters from the plan's `aio` section (an AioPlan: the schema's keys and defaults; None:
    the defaults), `values` replacing some. Every value is passed: the ops declare no defaults of their own."""
    aio = dataclasses.replace(AioPlan() if aio is None else aio, **values)
    return AioConfig(**{key: getattr(aio, key) for key in AioConfig.__dataclass_fields__})


def _proc_start_time(pid: int) -> str | None:
    """Start time of a live process (field 22 of /proc/<pid>/stat), None when there is no such process."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat_line.rsplit(")", 1)[1].split()[19]


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _is_root_name(name: str) -> bool:
    return name == SWAP_ROOT_PREFIX or name.startswith(SWAP_ROOT_PREFIX + "-")


def is_swap_dir(path) -> bool:
    """True for a directory made by SwapDir, any user's (checkpoint loaders should refuse these)."""
    path = Path(path)
    return _is_root_name(path.name) or os.path.lexists(path / MARKER) or _is_root_name(path.parent.name)


def open_own_dir(name, dir_fd: int | None = None, shown=None, private: bool = False) -> int:
    """A descriptor of the directory `name` (relative to dir_fd): never through a link (O_NOFOLLOW), owned by this
    user (euid) and writable by nobody else (private: no group/other access at all). OSError naming it otherwise."""
    shown = shown if shown is not None else name
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise OSError(errno.ELOOP, f"{shown} is a symbolic link or not a directory; the swap space is made only "
                      f"in a real directory of this user's (remove it)", str(shown)) from None
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & (0o077 if private else 0o022):
        os.close(fd)
        raise FileExistsError(errno.EEXIST, f"{shown} belongs to uid {st.st_uid} with mode "
                              f"{stat.S_IMODE(st.st_mode):o}: not this user's (uid {os.geteuid()}) alone, so another "
                              f"user of the disk could replace what is in it; fsdpzero makes it itself with mode 700: "
                              f"remove it", str(shown))
    return fd


def _read_marker(base_fd: int, name: str) -> dict:
    """The marker of base/<name>, or {} when there is none that is a regular file of at most MARKER_MAX bytes."""
    try:
        dfd = os.open(name, _DIR_FLAGS, dir_fd=base_fd)
    except OSError:
        return {}
    try:
        fd = os.open(MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except OSError:
        return {}
    finally:
        os.close(dfd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return {}
        data = os.read(fd, MARKER_MAX + 1)
    except OSError:
        return {}
    finally:
        os.close(fd)
    try:
        marker = json.loads(data) if len(data) <= MARKER_MAX else {}
    except ValueError:
        return {}
    return marker if isinstance(marker, dict) else {}


def _remove_stale(base_fd: int, base: Path) -> list[Path]:
    """Remove this user's swap directories in base (held open) left by dead processes of this host."""
    host, removed = socket.gethostname(), []
    for name in os.listdir(base_fd):
        try:
            owner_host, pid, _, _ = name.rsplit(".", 3)
            pid = int(pid)
        except ValueError:
            continue                       # not ours: leave it alone
        if owner_host != host:
            continue                       # another node's process: we cannot tell whether it is alive
        try:
            st = os.stat(name, dir_fd=base_fd, follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            continue                       # a link, a file, another user's: not ours to look into
        marker = _read_marker(base_fd, name)
        alive = (_proc_start_time(pid) is not None and marker.get("boot_id", _boot_id()) == _boot_id()
                 and marker.get("start_time", _proc_start_time(pid)) == _proc_start_time(pid))
        if not alive:
            shutil.rmtree(name, dir_fd=base_fd, ignore_errors=True)
            removed.append(base / name)
    return removed


def remove_stale_swap_dirs(nvme_path) -> list[Path]:
    """Remove swap directories under nvme_path left by dead processes of this host (killed runs). Returns them."""
    base = Path(nvme_path) / SWAP_ROOT
    try:
        base_fd = open_own_dir(base)
    except OSError:                        # none, a link, another user's: nothing of ours to clean
        return []
    try:
        removed = _remove_stale(base_fd, base)
    finally:
        os.close(base_fd)
    if removed:
        try:
            base.rmdir()                       # only if no live directory remains
        except OSError:
            pass
    return removed


def _private_dir(root: Path, rank: int) -> tuple[Path, int, int]:
    """(path, descriptor of root/SWAP_ROOT, descriptor of the new directory) for
    root/SWAP_ROOT/<host>.<pid>.<n>.rank<r>, made by this call with mode 0700 (mkdir is exclusive): never a
    directory or link someone else planted under that predictable name (a taken name moves on to the next n)."""
    base = root / SWAP_ROOT
    for attempt in range(1000):
        root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)   # needs no read permission
        try:
            try:
                os.mkdir(SWAP_ROOT, 0o700, dir_fd=root_fd)   # again each time: another rank may just have removed it
            except FileExistsError:
                pass
            base_fd = open_own_dir(SWAP_ROOT, root_fd, base)
        finally:
            os.close(root_fd)
        try:
            if attempt == 0:
                _remove_stale(base_fd, base)
            name = f"{socket.gethostname()}.{os.getpid()}.{next(_instances)}.rank{rank}"
            try:
                os.mkdir(name, 0o700, dir_fd=base_fd)
            except (FileExistsError, FileNotFoundError):   # taken; or base removed by another rank meanwhile
                os.close(base_fd)
                continue
            return base / name, base_fd, open_own_dir(name, base_fd, base / name, private=True)
        except BaseException:
            os.close(base_fd)
            raise
    raise FileExistsError(errno.EEXIST, f"no free swap directory name under {base}", str(base))


class SwapDir:
    """This process's swap directory under nvme_path; `key` names the config key in error messages."""

    def __init__(self, nvme_path, rank: int = 0, key: str = "offload_optimizer.nvme_path"):
        if nvme_path is None:
            raise ValueError(f"config key '{key}' is not set: NVMe offload needs a directory on a fast local disk, "
                             f"e.g. \"{key.rsplit('.', 1)[-1]}\": \"/local_nvme\"")
        self.key, self.root = key, Path(nvme_path)
        self.fd = base_fd = None
        try:
            if not self.root.exists():
                raise FileNotFoundError(errno.ENOENT, f"config key '{key}' = {str(self.root)!r}: the directory "
                                        "does not exist; create it (mkdir -p) or point it at a directory on the "
                                        "NVMe disk", str(self.root))
            if not self.root.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"config key '{key}' = {str(self.root)!r} is not a "
                                         "directory", str(self.root))
            self.path, base_fd, self.fd = _private_dir(self.root, rank)
            marker = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=self.fd)
            with os.fdopen(marker, "w") as f:
                f.write(json.dumps(
                    {"what": "fsdpzero NVMe swap space (optimizer states of a running job); not a checkpoint",
                     "pid": os.getpid(), "start_time": _proc_start_time(os.getpid()), "boot_id": _boot_id(),
                     "rank": rank}))
        except BaseException as e:
            if self.fd is not None:
                shutil.rmtree(self.path.name, dir_fd=base_fd, ignore_errors=True)
                os.close(self.fd)
            if base_fd is not None:
                os.close(base_fd)
            if isinstance(e, OSError):
                self._raise_named(e)
            raise
        self._finalizer = weakref.finalize(self, _remove_swap_dir, self.path, base_fd, self.fd, os.getpid())

    def _raise_named(self, e: OSError):
        key = self.key
        if isinstance(e, PermissionError):
            raise PermissionError(errno.EACCES, f"config key '{key}' = {str(self.root)!r}: not writable (or not "
                                  f"reachable) by this user (uid {os.getuid()}); fix its permissions or choose "
                                  "another directory", str(self.root)) from None
        if f"config key '{key}'" in str(e.strerror):   # a read-only mount (EROFS), /proc, ...: name the key
            raise e
        raise OSError(e.errno, f"config key '{key}' = {str(self.root)!r}: cannot create swap space there "
                      f"({e.strerror or e}); point it at a writable directory on the NVMe disk",
                      str(self.root)) from None

    def create_file(self, name: str, direct: bool = True) -> AioFile:
        """A new swap file in this directory, created relative to the directory's descriptor (O_CREAT | O_EXCL |
        O_NOFOLLOW): never through a name or a directory someone else put there."""
        return open_file(self.path / name, write=True, direct=direct, exclusive=True, dir_fd=self.fd)

    def check_space(self, nbytes: int) -> None:
        """Fail now, not mid-step: the file system must take an O_DIRECT write and have `nbytes` free."""
        probe = ".write_probe"
        try:
            with AioHandle(aio_config(block_size=ALIGN), backend="python") as h, self.create_file(probe) as f:
                h.pwrite(aligned_empty(ALIGN), f).wait()
                os.fsync(f.fd)
        except OSError as e:
            raise OSError(e.errno, f"config key '{self.key}' = {str(self.root)!r}: cannot write swap files in "
                          f"{self.path}: {e.strerror or e}") from None
        finally:
            try:
                os.unlink(probe, dir_fd=self.fd)
            except FileNotFoundError:
                pass
        free = shutil.disk_usage(self.path).free
        if free < nbytes:
            raise OSError(errno.ENOSPC, f"config key '{self.key}' = {str(self.root)!r}: NVMe offload of this rank "
                          f"needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of swap space, the file system has "
                          f"{free} bytes ({free / 2**30:.2f} GiB) free; free space, use a bigger disk, or offload "
                          "to \"cpu\"")

    def close(self) -> None:
        self._finalizer()


def _remove_swap_dir(path: Path, base_fd: int, fd: int, owner_pid: int) -> None:
    try:
        if os.getpid() == owner_pid:      # not from a forked child: the directory is its parent's
            shutil.rmtree(path.name, dir_fd=base_fd, ignore_errors=True)   # by descriptor: the one made
            try:
                path.parent.rmdir()       # the fsdpzero_swap-<uid> folder too, once no rank uses it (if empty)
            except OSError:
                pass
    finally:
        os.close(fd)
        os.close(base_fd)


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
