"""Multi-rank test harness: N ranks on CPU with gloo, forked from the pytest process (or, with backend="nccl" or
"cuda:nccl,cpu:gloo", N spawned ranks, one GPU each: the GPU tests' NCCL paths).

Forking after torch/transformers are imported in the parent costs ~1 s per job instead of ~10 s of imports per rank
(spawn). A forked child has the parent's memory but only the forking thread: a parent with native threads (gloo's
workers of a group something still holds, the OpenMP pool a multi-threaded op left, aio workers) hands its ranks
their objects and locks without the threads, and a rank then hangs (a rank's main thread running a parallel region
on 2 threads after the parent ran one: tests/project/test_multirank.py) or worse. So ranks are forked only from a
parent without native threads (after a gc.collect(), which ends dead groups and engines here, where their threads
are); otherwise they are spawned, with a warning naming the threads.

Each rank runs with one compute thread (two ranks share the CI machine's two cores; more threads than cores was
measured 37x slower), gets a file:// rendezvous in its own temp dir (no ports to collide), a short gloo timeout, and
the whole job a hard wall-clock limit. Return values come back through torch.save files.
"""
from __future__ import annotations

import datetime
import faulthandler
import gc
import os
import signal
import socket
import tempfile
import threading
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Native threads whose library prepares for fork itself: jemalloc (imported with pyarrow, e.g. through datasets)
# takes its locks around fork and restarts its background thread in the child.
FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def native_threads() -> list[str]:
    """Names of this process's threads that Python did not start (gloo's workers, an OpenMP pool, aio workers),
    except those in FORK_SAFE_THREADS."""
    python = {t.native_id for t in threading.enumerate() if not isinstance(t, threading._DummyThread)}
    names = []
    for tid in os.listdir("/proc/self/task"):
        if int(tid) not in python:
            try:
                names.append(Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:   # it ended
                pass
    return sorted(n for n in names if n not in FORK_SAFE_THREADS)


def _start_method(job: str) -> str:
    """fork where it is safe, else spawn (see the module docstring)."""
    # fork is ~10x cheaper, but CUDA does not survive it, and merely counting devices in the parent poisons fork for
    # the children: on a CUDA machine, spawn
    if torch.cuda.is_available():
        return "spawn"
    if native_threads():
        gc.collect()
    native = native_threads()
    if not native:
        return "fork"
    warnings.warn(f"multi-rank job {job}: the test process has native threads ({', '.join(native)}); forked ranks "
                  f"would inherit their objects and locks without them, so the ranks are spawned (slower). Run "
                  f"multi-threaded work of a test in a rank or a subprocess", RuntimeWarning, stacklevel=3)
    return "spawn"


def _child(rank: int, fn: Callable, world_size: int, workdir: str, init_pg: bool, port: int, args: tuple,
           backend: str = "gloo") -> None:
    faulthandler.enable()   # a rank killed by a signal (a SIGSEGV seen once in gloo) prints its Python stack
    faulthandler.register(signal.SIGUSR1, all_threads=True)   # run_distributed's timeout asks where it hangs
    Path(workdir, f"stacks_{rank}").touch()   # from now on SIGUSR1 prints the stacks (before, it would kill)
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    out = Path(workdir) / f"result_{rank}.pt"
    try:
        device = None
        if "nccl" in backend:   # one GPU per rank, bound before any collective (NCCL picks it from device_id)
            device = torch.device("cuda", rank)
            torch.cuda.set_device(device)
        if init_pg:
            dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=60), device_id=device)
        result = fn(rank, world_size, *args)
        torch.save({"ok": True, "result": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _dump_stacks(processes, workdir: str) -> None:
    """Each live rank prints every thread's Python stack to its stderr (faulthandler, registered by _child; a rank
    still starting up is left alone: SIGUSR1's default action would kill it)."""
    for rank, p in enumerate(processes):   # one at a time: two ranks writing at once interleave their lines
        if p.is_alive() and Path(workdir, f"stacks_{rank}").exists():
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
            time.sleep(0.5)


def run_distributed(fn: Callable[..., Any], world_size: int = 2, *args: Any, timeout: float = 180.0,
                    init_pg: bool = True, backend: str = "gloo") -> list[Any]:
    """Run fn(rank, world_size, *args) on `world_size` forked gloo ranks; return each rank's result.

    backend: "gloo" (CPU, the default), or "nccl" (NCCL alone, as Hugging Face Accelerate creates it) or
    "cuda:nccl,cpu:gloo" (as fsdpzero creates it): rank r on GPU r, the 60 s timeout enforced by NCCL's watchdog.

    init_pg=False leaves process-group creation to the code under test (RANK/WORLD_SIZE/MASTER_* are set, as
    torchrun does). fn must be a module-level function. Raises with the failing rank's traceback, or on timeout.
    """
    if dist.is_initialized():
        raise RuntimeError("a process group is initialised in the test process: forked ranks would inherit it")
    with tempfile.TemporaryDirectory(prefix="fsdpzero_mr_") as workdir:
        method = _start_method(fn.__name__)
        if "nccl" in backend and torch.cuda.device_count() < world_size:
            raise RuntimeError(f"{backend} with {world_size} ranks needs {world_size} GPUs, "
                               f"{torch.cuda.device_count()} visible")
        ctx = mp.start_processes(_child, args=(fn, world_size, workdir, init_pg, free_port(), args, backend),
                                 nprocs=world_size, join=False, start_method=method)
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    _dump_stacks(ctx.processes, workdir)
                    raise TimeoutError(f"multi-rank job {fn.__name__} exceeded {timeout:.0f} s")
        except mp.ProcessRaisedException:
            pass  # the rank's own traceback, saved below, is more useful
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        paths = [Path(workdir) / f"result_{rank}.pt" for rank in range(world_size)]
        # our own temp files, written just now by our own ranks
        loaded = [torch.load(p, weights_only=False) if p.exists() else None for p in paths]
        # A failing rank gets the others terminated before they write: report its traceback, not their silence.
        for rank, r in enumerate(loaded):
            if r is not None and not r["ok"]:
                raise RuntimeError(f"rank {rank} of {fn.__name__} failed:\n{r['error']}")
        for rank, r in enumerate(loaded):
            if r is None:   # a signal shows as a negative exit code (-11: SIGSEGV); faulthandler printed its stack
                raise RuntimeError(f"rank {rank} of {fn.__name__} ({method}ed) died without a result, exit code "
                                   f"{ctx.processes[rank].exitcode}")
        return [r["result"] for r in loaded]
