"""The native aio engine's threads: started all or none (a failed thread start used to abort the process from inside
the C++ constructor: `terminate called after throwing an instance of 'std::system_error'`), joined when the handle
is closed, collected or the interpreter exits, and never joined by a forked child (which has the engine's memory
but not its threads). Each case runs in a fresh interpreter: what is tested is how that process ends."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fsdpzero_ops.aio import backend_available

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(not backend_available("threads"), reason="the native aio op cannot be built here")


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_refused_threads_raise_instead_of_aborting():
    proc = _python("""
        import resource
        from fsdpzero.offload.swapdir import aio_config
        from fsdpzero_ops.aio import AioHandle
        AioHandle(aio_config(), backend="threads").close()        # built and loaded before the limit
        vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))   # 16384 stacks won't fit
        try:
            AioHandle(aio_config(intra_op_parallelism=512, queue_depth=32), backend="threads")
        except RuntimeError as e:
            print("refused:", e)
    """)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused: fsdpzero aio: could not start the threads engine" in proc.stdout
    assert "lower intra_op_parallelism/queue_depth" in proc.stdout


@pytest.mark.parametrize("backend", ["threads", "io_uring", "libaio"])
def test_unclosed_handle_finishes_its_writes_at_exit_and_a_fork_child_exits(tmp_path, backend):
    if not backend_available(backend):
        pytest.skip(f"{backend} is not usable here")
    target = tmp_path / "data.bin"
    proc = _python(f"""
        import os, sys, torch
        from fsdpzero.offload.swapdir import aio_config
        from fsdpzero_ops.aio import AioHandle, aligned_empty
        handle = AioHandle(aio_config(), backend={backend!r})
        f = handle.open({str(target)!r}, write=True)
        buf = aligned_empty(1 << 22)
        buf.fill_(7)
        handle.pwrite(buf, f)                    # in flight; never waited for, never closed
        pid = os.fork()
        if pid == 0:
            sys.exit(0)                          # a normal exit in the child: finalizers run there too
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
    """, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "child 0" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert target.read_bytes() == bytes([7]) * (1 << 22)
