"""Process group and device from the launcher's environment (torchrun, or DeepSpeed's launcher).

torchrun exports RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT; DeepSpeed's launcher also passes
`--local_rank=N` on the command line. No RANK means a single process: a one-rank group on an in-memory store, so
the same FSDP2 code runs without a launcher.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import functools
import hashlib
import json
import os
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def device_type(self) -> str:
        return self.device.type


def local_rank_from_argv(argv: list[str] | None = None) -> int | None:
    """`--local_rank=N` / `--local_rank N` / `--local-rank N` as DeepSpeed's launcher passes it."""
    argv = sys.argv if argv is None else argv
    for i, a in enumerate(argv):
        for flag in ("--local_rank", "--local-rank"):
            if a.startswith(flag + "="):
                return int(a.split("=", 1)[1])
            if a == flag and i + 1 < len(argv):
                return int(argv[i + 1])
    return None


def detect_device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(device_type: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join (or create) the default process group. GPU: `cuda:nccl,cpu:gloo` so CPU tensors (offload, the
    stage-1 CPU path) have a backend too. CPU: gloo. Reuses a group the caller already initialised."""
    device_type = device_type or detect_device_type()
    if "LOCAL_RANK" not in os.environ and (lr := local_rank_from_argv()) is not None:
        os.environ["LOCAL_RANK"] = str(lr)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout,
                                    device_id=device if device_type == "cuda" else None)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank, device=device)


def join_before_accelerate(timeout_s: float) -> None:
    """Under a launcher (RANK set), create our default group before accelerate's PartialState does: it reuses an
    existing group, and on GPUs would otherwise create NCCL alone, where offload's CPU shards (their grad-norm
    all-reduce) find no backend ("No backend type associated with device type cpu", seen on 2 and 4 H200s)."""
    if "RANK" in os.environ and not dist.is_initialized():
        init_distributed(timeout_s=timeout_s)


@torch.no_grad()
def broadcast_module(module: torch.nn.Module, src: int = 0) -> None:
    """Make every rank start from rank `src`'s weights and buffers, as DeepSpeed and DDP do at wrap time
    (FSDP2 trusts each rank to have built the same model)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=src)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard, any other tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


# The name parts torch's module wrappers insert in parameter names: activation checkpointing's checkpoint_wrapper,
# torch.compile's OptimizedModule, FSDP1. Declared once; the checkpoint, zero.Init and HF loading code strip them.
WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def clean_fqn(name: str) -> str:
    """Parameter name as the unwrapped model has it (WRAPPER_PARTS removed)."""
    for wrapper in WRAPPER_PARTS:
        name = name.replace(wrapper, "")
    return name


# -- errors and facts agreed across ranks ----------------------------------------------------------------------------
# A failure on one rank (a path, the disk, a bad value) must not leave the others waiting in the next collective
# until the process-group timeout: the ranks first agree that something failed, then all raise the same error.

class RanksError(RuntimeError):
    """Raised on every rank with the same message: some rank failed, or the ranks disagree (see agree_on_error and
    check_same_on_all_ranks). `per_rank`: {rank: message} of the ranks concerned."""

    def __init__(self, message: str, per_rank: dict[int, str] | None = None):
        super().__init__(message)
        self.per_rank = per_rank or {}


def _group_size(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _comm_device(group) -> torch.device:
    """CPU tensors where the group has gloo (fsdpzero's groups always do); a NCCL-only group needs the GPU."""
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_text(text: str, max_len: int, group) -> list[str]:
    """Every rank's `text` (UTF-8, max_len bytes each), without pickle: one all-gather of padded byte tensors."""
    device = _comm_device(group)
    data = text.encode()[:max_len]
    buf = torch.zeros(max_len + 8, dtype=torch.uint8, device=device)
    buf[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if data:
        buf[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = [torch.empty_like(buf) for _ in range(_group_size(group))]
    dist.all_gather(out, buf, group=group)
    texts = []
    for t in out:
        raw = bytes(t.cpu().tolist())   # no numpy: the error report must not fail on what it reports
        n = int.from_bytes(raw[:8], "little")
        texts.append(raw[8:8 + n].decode(errors="replace"))
    return texts


def _describe(error: BaseException | str) -> str:
    return error if isinstance(error, str) else f"{type(error).__name__}: {error}"


def agree_on_error(error: BaseException | str | None, group=None) -> None:
    """Collective over `group` (default: the world): every rank passes its own outcome, None for success. If any
    rank failed, every rank raises the same RanksError naming the failed ranks and their messages (a failed rank's
    own exception chained to it); otherwise it returns. Cost when all succeed: one all-reduce of one int64. Without
    a process group, or with one rank, `error` alone decides. Call it where every rank arrives, before the next
    collective; `agreed_errors()` wraps a block in it."""
    mine = "" if error is None else (_describe(error) or "error")
    if _group_size(group) > 1:
        length = torch.tensor([len(mine.encode())], dtype=torch.int64, device=_comm_device(group))
        dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group)
        longest = int(length.item())
        if longest == 0:
            return
        per_rank = {r: m for r, m in enumerate(_gather_text(mine, min(longest, 16384), group)) if m}
    elif error is None:
        return
    else:
        per_rank = {dist.get_rank(group) if dist.is_initialized() else 0: mine}
    if len(set(per_rank.values())) == 1:
        ranks = sorted(per_rank)
        message = (f"{next(iter(per_rank.values()))} (on rank{'s' if len(ranks) > 1 else ''} "
                   f"{', '.join(map(str, ranks))})")
    else:
        message = f"{len(per_rank)} ranks failed:\n" + "\n".join(f"  rank {r}: {m}"
                                                              for r, m in sorted(per_rank.items()))
    raise _error_class(per_rank)(message, per_rank) from (error if isinstance(error, BaseException) else None)


# A bad value is still a ValueError (a bad type a TypeError, a path an OSError) after the ranks agree on it: callers
# and the CLI catch those by class. RanksError subclasses that are also the builtin class every failed rank raised.
_AGREED_BUILTINS = {c.__name__: c for c in (ValueError, TypeError, KeyError, FileNotFoundError, FileExistsError,
                                            NotADirectoryError, IsADirectoryError, PermissionError, OSError)}
_typed_errors: dict[str, type] = {}


def _error_class(per_rank: dict[int, str]) -> type:
    names = {m.split(":", 1)[0] for m in per_rank.values()}
    if len(names) != 1 or (name := names.pop()) not in _AGREED_BUILTINS:
        return RanksError
    if name not in _typed_errors:
        _typed_errors[name] = type(f"Ranks{name}", (RanksError, _AGREED_BUILTINS[name]),
                                   {"__init__": RanksError.__init__, "__str__": lambda self: self.args[0],
                                    "__module__": __name__})
    return _typed_errors[name]


@contextlib.contextmanager
def agreed_errors(group=None):
    """`with agreed_errors(): <code every rank runs>`: an exception inside the block on any rank becomes the same
    RanksError on all of them (agree_on_error runs after the block, success or not). Only Exceptions are agreed;
    KeyboardInterrupt and SystemExit pass through as they are."""
    try:
        yield
    except Exception as e:   # noqa: BLE001  agreed, then raised on every rank
        agree_on_error(e, group)
        raise   # not reached: agree_on_error raises
    agree_on_error(None, group)


def check_same_on_all_ranks(facts: dict[str, str], what: str, group=None, limit: int = 8) -> None:
    """Collective: every rank's `facts` ({name: value}, text) must be identical; cost: one all-gather of a 64-bit
    digest. On a mismatch the facts are gathered and every rank raises the same RanksError listing, per differing
    name, which ranks have which value (the first `limit` differences). `what` names the thing compared."""
    if _group_size(group) == 1:
        return
    digest = hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).digest()
    digest = int.from_bytes(digest[:8], "little", signed=True)
    device = _comm_device(group)
    mine = torch.tensor([digest], dtype=torch.int64, device=device)
    digests = [torch.empty_like(mine) for _ in range(_group_size(group))]
    dist.all_gather(digests, mine, group=group)
    if len({int(d.item()) for d in digests}) == 1:
        return
    blob = json.dumps(list(facts.items()))   # in the caller's order: the message lists differences that way
    size = torch.tensor([len(blob.encode())], dtype=torch.int64, device=device)
    dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
    every = [dict(json.loads(t)) for t in _gather_text(blob, int(size.item()), group)]
    names = list(dict.fromkeys(k for f in every for k in f))   # first rank's order first
    lines = []
    for name in names:
        values = [f.get(name, "(absent)") for f in every]
        if len(set(values)) == 1:
            continue
        by_value: dict[str, list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(r)
        lines.append(f"  {name}: " + "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'have' if len(rs) > 1 else 'has'} {v}"
            for v, rs in by_value.items()))
    shown = lines[:limit] + ([f"  ... and {len(lines) - limit} more differences"] if len(lines) > limit else [])
    raise RanksError(f"the ranks were started with different {what}; every rank must run the same:\n"
                     + "\n".join(shown))


# -- interpreter exit ------------------------------------------------------------------------------------------------
# A gloo worker thread marks a collective complete and only then drops its reference to the collective's tensors.
# For a tensor Python also holds, that drop takes the GIL (torch 2.13: while C++ holds a second reference, the
# tensor keeps its PyObject alive, and giving it up decrefs the PyObject). If the worker is still waiting for the GIL
# when the interpreter starts finalizing, CPython ends it with pthread_exit as soon as it gets the GIL; the unwinding
# meets a noexcept destructor (~AsyncWork): `terminate called without an active exception`, SIGABRT, exit -6, after
# the script's last line (core: runLoop -> ~AsyncAllreduceWork -> decref_pyobject -> take_gil ->
# PyThread_exit_thread -> std::terminate). `dist.destroy_process_group()` does not end the workers while anything
# still holds the group (FSDP2's modules hold their mesh's groups), and ProcessGroupGloo has no shutdown of its own
# (Backend.shutdown is a no-op for gloo). (pytorch/pytorch#190489 shows the same abort, a group left undestroyed.)
#
# So at exit, before finalization, the main thread lets go of the GIL until no native thread wants it. A fixed
# pause (0.05 s, then 0.25 s) cannot promise that: a woken worker may get no CPU in time on a loaded host (one rank
# of a 4-rank `fsdpzero launch` aborted with the 0.05 s pause on a 2-core CI host). tests/engine/
# test_exit_gil_handover.py makes the worker late on purpose: 4 of 4 runs aborted with the 0.25 s pause. Now the
# main thread sleeps in slices and looks, between them, at two things: the interpreter's thread states without a
# Python frame (a native thread taking the GIL through pybind11's gil_scoped_acquire or PyGILState_Ensure has one
# from before it waits until after it let go; CPython's C API, reached with ctypes) and the native threads the
# kernel lists as runnable (a waiter that was woken but has no CPU yet, or a worker between completing a collective
# and dropping it). It returns when
# none is runnable and no frameless thread state is left, or when the same frameless states stayed through
# PARKED_CHECKS quiet slices (a thread parked with one, as torch's CUDA autograd threads are for life, never takes
# the GIL here), or after EXIT_GIL_HANDOVER_MAX_S (a native thread that never stops running).
EXIT_GIL_HANDOVER_MAX_S = 10.0
EXIT_GIL_HANDOVER_SLICE_S = 0.01
EXIT_GIL_HANDOVER_FALLBACK_S = 0.25   # without /proc nothing can be seen: a fixed pause, as before
PARKED_CHECKS = 3


@functools.lru_cache(maxsize=1)
def _thread_state_api():
    """CPython's thread-state API through ctypes (PyDLL: the GIL stays held during the calls); None elsewhere."""
    try:
        api = ctypes.PyDLL(None)
        for name, restype, argtypes in (("PyInterpreterState_Get", ctypes.c_void_p, []),
                                        ("PyInterpreterState_ThreadHead", ctypes.c_void_p, [ctypes.c_void_p]),
                                        ("PyThreadState_Next", ctypes.c_void_p, [ctypes.c_void_p]),
                                        ("PyThreadState_GetFrame", ctypes.c_void_p, [ctypes.c_void_p]),
                                        ("PyThreadState_GetID", ctypes.c_uint64, [ctypes.c_void_p]),
                                        ("Py_DecRef", None, [ctypes.c_void_p])):
            fn = getattr(api, name)
            fn.restype, fn.argtypes = restype, argtypes
        return api
    except (AttributeError, OSError):
        return None


def _frameless_thread_states() -> frozenset[int] | None:
    """IDs of this interpreter's thread states that have no Python frame: native threads inside a GIL acquisition
    (waiting for it, while the caller holds it) or parked with a thread state. None where the API is out of reach."""
    api = _thread_state_api()
    if api is None:
        return None
    ids = set()
    tstate = api.PyInterpreterState_ThreadHead(api.PyInterpreterState_Get())
    while tstate:
        frame = api.PyThreadState_GetFrame(tstate)   # a new reference, or NULL
        if frame:
            api.Py_DecRef(frame)
        else:
            ids.add(api.PyThreadState_GetID(tstate))
        tstate = api.PyThreadState_Next(tstate)
    return frozenset(ids)


def _runnable_native_threads() -> int:
    """How many threads of this process that Python did not start are runnable (state R) now."""
    python = {t.native_id for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    count = 0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) in python:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                stat = f.read()
        except OSError:   # it ended
            continue
        state = stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3]   # after "(comm)", which may hold spaces
        count += state == b"R"
    return count


def hand_over_gil(max_seconds: float = EXIT_GIL_HANDOVER_MAX_S) -> None:
    """Let go of the GIL, in slices, until no native thread (gloo's workers, ...) wants it: see above. Runs at
    interpreter exit; harmless at any other time. Returns at once where every thread is Python's."""
    try:
        if len(os.listdir("/proc/self/task")) <= threading.active_count():
            return
    except OSError:   # no /proc: cannot tell, wait anyway
        time.sleep(EXIT_GIL_HANDOVER_FALLBACK_S)
        return
    deadline = time.monotonic() + max_seconds
    quiet, seen = 0, None
    while time.monotonic() < deadline:
        time.sleep(EXIT_GIL_HANDOVER_SLICE_S)   # the GIL released: a thread waiting for it is woken and takes it
        states = _frameless_thread_states()
        if _runnable_native_threads():
            quiet, seen = 0, states
            continue
        if states is not None and not states:
            return
        quiet = quiet + 1 if states == seen else 1
        seen = states
        if quiet >= PARKED_CHECKS:
            return


class _ExitAnchor:
    """Lives as long as this module; its finalizer runs hand_over_gil at interpreter exit."""


_exit_anchor = _ExitAnchor()
# A weakref.finalize rather than atexit.register: at exit the finalizers run newest first, so the engines' own
# (closing their offload threads and queues, created after this import) run before this one.
weakref.finalize(_exit_anchor, hand_over_gil)
