"""Async tensor I/O to files opened with O_DIRECT: the engine under NVMe offload.

    handle = AioHandle(AioConfig(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1, single_submit=False,
                                 overlap_events=True))
    f = handle.open("/nvme/swap/x.bin", write=True)
    buf = aligned_empty(1000, dtype=torch.float32)      # page-aligned, pinned when a GPU exists
    req = handle.pwrite(buf, f, offset=0)               # returns at once
    ...
    req.wait()                                          # raises OSError naming file, offset and errno

Backends ("auto" picks the first that works): io_uring and libaio (the kernel's own queues, driven through raw syscalls
by ops/csrc/aio.cpp, so neither liburing nor libaio needs to be installed), threads (a pool over blocking
pread/pwrite in the same C++ file) and python (os.preadv/os.pwritev in a thread pool: the reference, and the fallback
when nothing can be compiled). All four cut a request into `block_size` chunks and keep many chunks in flight.

O_DIRECT rules: file offsets must be multiples of ALIGN. Buffers and lengths need not be: unaligned chunks go through
an aligned bounce buffer, and a write of n bytes occupies padded_nbytes(n) bytes of the file (zero padded).
File systems that refuse O_DIRECT get buffered I/O, with one warning.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
import warnings
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from .build import extensions_dir, load_op

ALIGN = 4096                     # O_DIRECT alignment that satisfies 512-byte and 4 KiB logical blocks
BACKENDS = ("io_uring", "libaio", "threads", "python")
_NATIVE = {"io_uring": 0, "libaio": 1, "threads": 2}
def padded_nbytes(nbytes: int) -> int:
    """File bytes a tensor of `nbytes` occupies: the next multiple of ALIGN (lay tensors out at these offsets)."""
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True, kw_only=True)
class AioConfig:
    """The engine's parameters as plain values, none defaulted. What they mean, DeepSpeed's defaults and the checks
    of a ds_config's `aio` section are declared once, in the library's schema (fsdpzero.config.sections.Aio), which
    fills every one; this package never imports the library. Only what the engine itself needs is checked here."""

    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    single_submit: bool
    overlap_events: bool

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size % ALIGN:
            raise ValueError(f"aio block_size={self.block_size}: must be a positive multiple of {ALIGN} "
                             "(O_DIRECT alignment)")
        for key in ("queue_depth", "intra_op_parallelism"):
            if getattr(self, key) < 1:
                raise ValueError(f"aio {key}={getattr(self, key)}: must be >= 1")


def aligned_empty(numel: int, dtype: torch.dtype = torch.uint8, pin: bool | None = None) -> torch.Tensor:
    """A 1-D CPU tensor whose storage starts on an ALIGN boundary and has room up to padded_nbytes; pinned
    (page-locked) when a GPU exists and `pin` is not False."""
    if pin is None:
        pin = torch.cuda.is_available()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.empty(padded_nbytes(nbytes) + ALIGN, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % ALIGN
    return raw[start:start + padded_nbytes(nbytes)][:nbytes].view(dtype)


# --------------------------------------------------------------------------------------------------- native engine

@lru_cache(maxsize=None)
def _native_lib():
    name = load_op("fsdpzero_aio", ("aio.cpp",))
    if name is None:
        return None
    lib = ctypes.CDLL(str(extensions_dir() / name / f"{name}.so"))
    i64, c_int, vp = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    lib.fz_aio_backend_available.argtypes, lib.fz_aio_backend_available.restype = [c_int], c_int
    lib.fz_aio_create.argtypes = [c_int, i64, c_int, c_int, c_int, c_int, i64]
    lib.fz_aio_create.restype = vp
    lib.fz_aio_destroy.argtypes, lib.fz_aio_destroy.restype = [vp], None
    lib.fz_aio_submit.argtypes, lib.fz_aio_submit.restype = [vp, c_int, c_int, vp, i64, i64], i64
    lib.fz_aio_poll.argtypes, lib.fz_aio_poll.restype = [vp, i64], c_int
    lib.fz_aio_wait.argtypes, lib.fz_aio_wait.restype = [vp, i64, ctypes.POINTER(i64)], c_int
    return lib


@lru_cache(maxsize=None)
def backend_available(backend: str, build: bool = True) -> bool:
    """build=False (the library's no_build knob): the native op is never compiled, so only "python" is."""
    if backend == "python":
        return True
    lib = _native_lib() if build else None
    return lib is not None and bool(lib.fz_aio_backend_available(_NATIVE[backend]))


def available_backends(build: bool = True) -> list[str]:
    return [b for b in BACKENDS if backend_available(b, build)]


class _NativeEngine:
    """ctypes calls drop the GIL, so wait() blocks only the calling thread."""

    def __init__(self, backend: str, cfg: AioConfig):
        self._lib = _native_lib()
        self._ptr = self._lib.fz_aio_create(_NATIVE[backend], cfg.block_size, cfg.queue_depth,
                                            cfg.intra_op_parallelism, int(cfg.single_submit),
                                            int(cfg.overlap_events), ALIGN)
        if not self._ptr:
            raise RuntimeError(f"fsdpzero aio: could not start the {backend} engine with {cfg} (bad sizes, or the "
                               "system refused the threads or kernel queues: lower intra_op_parallelism/queue_depth)")
        # its native threads are joined when the engine is closed, collected or the interpreter exits
        self._finalizer = weakref.finalize(self, _destroy_native, self._lib, self._ptr, os.getpid())

    def submit(self, fd, write, ptr, nbytes, offset) -> int:
        rid = self._lib.fz_aio_submit(self._ptr, fd, int(write), ptr, nbytes, offset)
        if rid < 0:
            raise OSError(-rid, os.strerror(-rid))
        return rid

    def poll(self, rid) -> bool:
        return self._lib.fz_aio_poll(self._ptr, rid) == 1

    def wait(self, rid) -> tuple[int, int]:
        off = ctypes.c_int64(-1)
        rc = self._lib.fz_aio_wait(self._ptr, rid, ctypes.byref(off))
        return -rc, off.value

    def close(self):
        self._finalizer()
        self._ptr = None


def _destroy_native(lib, ptr, pid: int) -> None:
    """Stop and join the engine's threads (after its queued chunks), in the process that started them only: a
    forked child has the engine's memory but not its threads, and joining those would hang."""
    if os.getpid() == pid:
        lib.fz_aio_destroy(ptr)


# ------------------------------------------------------------------------------------------- python reference engine

class _PythonEngine:
    """Same chunking and padding rules as aio.cpp, with os.preadv/os.pwritev (they drop the GIL) in a pool of
    intra_op_parallelism * queue_depth threads; single_submit and overlap_events have no meaning here."""

    def __init__(self, cfg: AioConfig):
        self._cfg = cfg
        self._pool = ThreadPoolExecutor(cfg.intra_op_parallelism * cfg.queue_depth, thread_name_prefix="fz-aio")
        self._requests: dict[int, list] = {}
        self._next = 0
        self._lock = threading.Lock()

    def submit(self, fd, write, ptr, nbytes, offset) -> int:
        direct = bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)
        if direct and offset % ALIGN:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        bs = self._cfg.block_size
        futures = [self._pool.submit(_chunk_io, fd, write, direct, ptr + at, min(bs, nbytes - at), offset + at)
                   for at in range(0, nbytes, bs)]
        with self._lock:
            self._next += 1
            self._requests[self._next] = futures
            return self._next

    def poll(self, rid) -> bool:
        return all(f.done() for f in self._requests[rid])

    def wait(self, rid) -> tuple[int, int]:
        with self._lock:
            futures = self._requests.pop(rid)
        results = [f.result() for f in futures]
        return next(((e, off) for e, off in results if e), (0, -1))

    def close(self):
        self._pool.shutdown(wait=True)


def _chunk_io(fd, write, direct, ptr, length, offset) -> tuple[int, int]:
    """One chunk: (0, -1) on success, else (errno, offset)."""
    user = memoryview((ctypes.c_char * length).from_address(ptr)).cast("B")
    bounce = None
    if direct and (ptr % ALIGN or length % ALIGN):
        bounce = mmap.mmap(-1, padded_nbytes(length))       # anonymous mappings are page-aligned
        if write:
            bounce[:length] = user
    buf = memoryview(bounce) if bounce is not None else user
    try:
        done = 0
        while done < len(buf):
            n = (os.pwritev if write else os.preadv)(fd, [buf[done:]], offset + done)
            done += n
            if n == 0 or (not write and done < len(buf)):
                break                                        # end of file
        need = length if (bounce is not None and not write) else len(buf)
        if done < need:
            return (errno.ENOSPC if write else errno.ENODATA), offset
        if bounce is not None and not write:
            user[:] = buf[:length]
        return 0, -1
    except OSError as e:
        return e.errno or errno.EIO, offset
    finally:
        buf.release()
        if bounce is not None:
            bounce.close()


# ------------------------------------------------------------------------------------------------------ public API

class AioFile:
    """An open file descriptor plus what the error messages need."""

    def __init__(self, path: Path, fd: int, direct: bool):
        self.path, self.fd, self.direct = path, fd, direct

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_warned_buffered: set[str] = set()


def open_file(path, write: bool = False, direct: bool = True, exclusive: bool = False,
              dir_fd: int | None = None) -> AioFile:
    """Open for O_DIRECT reads (or read+write, creating it); buffered, with one warning, where refused.
    Never through a symbolic link (O_NOFOLLOW). exclusive: create the file, failing if the name exists
    (O_EXCL): swap and scratch files, whose predictable names a planted link must not redirect. dir_fd: open
    path.name in that open directory (the private directory a swap or scratch file lives in, held open so that
    renaming or replacing a directory on the way to it cannot redirect the file); `path` names it in messages."""
    path = Path(path)
    flags = (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    name = path if dir_fd is None else path.name
    try:
        if exclusive:   # created first, O_DIRECT set after: a refused O_DIRECT must not leave the name taken
            fd = _open(name, flags | os.O_CREAT | os.O_EXCL, dir_fd)
            if not direct:
                return AioFile(path, fd, False)
            try:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
                return AioFile(path, fd, True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    os.close(fd)
                    raise
                _warn_buffered(path)
                return AioFile(path, fd, False)
        if direct:
            try:
                return AioFile(path, _open(name, flags | os.O_DIRECT, dir_fd), True)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _warn_buffered(path)
        return AioFile(path, _open(name, flags, dir_fd), False)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, f"fsdpzero aio: cannot open {path}: "
                                + (f"directory {path.parent} does not exist" if not path.parent.exists()
                                   else "no such file"), str(path)) from None
    except FileExistsError:
        raise FileExistsError(errno.EEXIST, f"fsdpzero aio: {path} exists already (a file is created only under a "
                              f"name nobody else holds)", str(path)) from None
    except PermissionError:
        raise PermissionError(errno.EACCES, f"fsdpzero aio: cannot open {path} for "
                              f"{'writing' if write else 'reading'}: permission denied (check the owner and mode "
                              f"of {path.parent})", str(path)) from None
    except OSError as e:
        if e.errno != errno.ELOOP:
            raise
        raise OSError(errno.ELOOP, f"fsdpzero aio: {path} is a symbolic link; fsdpzero never opens its I/O files "
                      f"through one", str(path)) from None


def _open(name, flags: int, dir_fd: int | None) -> int:
    return os.open(name, flags, 0o600) if dir_fd is None else os.open(name, flags, 0o600, dir_fd=dir_fd)


def _warn_buffered(path: Path) -> None:
    if str(path.parent) not in _warned_buffered:
        _warned_buffered.add(str(path.parent))
        warnings.warn(f"fsdpzero aio: the file system of {path.parent} refuses O_DIRECT; using buffered I/O "
                      "through the page cache (slower, and it uses host memory)", RuntimeWarning, stacklevel=3)


class AioRequest:
    """Handle of one submitted read or write: poll with done(), block with wait() (idempotent)."""

    def __init__(self, handle: "AioHandle", rid: int, op: str, file: AioFile, offset: int, nbytes: int):
        self._handle, self._rid = handle, rid
        self.op, self.file, self.offset, self.nbytes = op, file, offset, nbytes
        self._finished = False

    def done(self) -> bool:
        return self._finished or self._handle._engine.poll(self._rid)

    def wait(self) -> None:
        if self._finished:
            return
        err, at = self._handle._engine.wait(self._rid)
        self._finished = True
        self._handle._inflight.pop(self._rid, None)
        if err:
            hint = {errno.ENOSPC: " (disk full)", errno.EFBIG: " (file size limit reached: disk quota or ulimit -f)",
                    errno.ENODATA: " (the file ends before the requested range)"}.get(err, "")
            raise OSError(err, f"fsdpzero aio: {self.op} of {self.nbytes} bytes at offset {self.offset} of "
                          f"{self.file.path} failed at file offset {at}: {os.strerror(err)}{hint}",
                          str(self.file.path))


class AioHandle:
    """An I/O engine: `backend` one of BACKENDS or "auto" (io_uring, then libaio, threads, python); build=False:
    never compile the native op (python only). Both are arguments (the library passes its aio_backend and no_build
    knobs): this package keeps no settings."""

    def __init__(self, config: AioConfig, backend: str = "auto", build: bool = True):
        self.config = config
        if backend == "auto":
            backend = available_backends(build)[0]
        if backend not in BACKENDS:
            raise ValueError(f"aio backend {backend!r}: choose one of {BACKENDS} or 'auto'")
        if not backend_available(backend, build):
            raise RuntimeError(f"fsdpzero aio: backend {backend!r} is not usable here; available: "
                               f"{available_backends(build)}")
        self.backend = backend
        self._engine = _PythonEngine(self.config) if backend == "python" else _NativeEngine(backend, self.config)
        self._inflight: dict[int, tuple[AioRequest, torch.Tensor]] = {}   # keeps buffers alive until waited

    open = staticmethod(open_file)

    def pread(self, tensor: torch.Tensor, file: AioFile, offset: int = 0) -> AioRequest:
        return self._submit(tensor, file, offset, write=False)

    def pwrite(self, tensor: torch.Tensor, file: AioFile, offset: int = 0) -> AioRequest:
        return self._submit(tensor, file, offset, write=True)

    def _submit(self, tensor, file, offset, write) -> AioRequest:
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError(f"fsdpzero aio: needs a contiguous CPU tensor, got {tensor.device} "
                             f"contiguous={tensor.is_contiguous()}")
        if file.direct and offset % ALIGN:
            raise ValueError(f"fsdpzero aio: offset {offset} in {file.path} is not a multiple of {ALIGN} "
                             "(O_DIRECT); place tensors at multiples of padded_nbytes()")
        nbytes = tensor.numel() * tensor.element_size()
        rid = self._engine.submit(file.fd, write, tensor.data_ptr(), nbytes, offset)
        req = AioRequest(self, rid, "write" if write else "read", file, offset, nbytes)
        self._inflight[rid] = (req, tensor)
        return req

    def wait_all(self) -> None:
        """Wait for every request still in flight; raises the first error after all have finished."""
        first = None
        for req, _ in list(self._inflight.values()):
            try:
                req.wait()
            except OSError as e:
                first = first or e
        if first:
            raise first

    def close(self) -> None:
        if self._engine is not None:
            try:
                self.wait_all()
            finally:
                self._engine.close()
                self._engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
