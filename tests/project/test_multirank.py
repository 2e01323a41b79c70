"""tests/multirank.py forks ranks only from a parent without native threads. A forked child has the parent's memory
but only the forking thread: after the parent ran an op on 2 OpenMP threads (as tests/ops/test_cpu_adam.py does in
the pytest process), a rank whose main thread runs a parallel region on 2 threads (as host placement sets a rank's
threads) waits forever for pool threads that exist only in the parent. The harness then spawns the ranks instead.
Run in a fresh interpreter: the pytest process must not be left with an OpenMP pool itself."""
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.multirank import run_distributed

ROOT = Path(__file__).resolve().parents[2]

_PARENT = """
import torch
from tests.multirank import native_threads, run_distributed
from tests.project.test_multirank import two_thread_sum
torch.set_num_threads(2)
torch.ones(4_000_000).exp_().sum()    # a parallel region: libgomp keeps its pool of threads in this process
torch.set_num_threads(1)
print("parent native threads:", native_threads(), flush=True)
print("result", run_distributed(two_thread_sum, 2, timeout=45), flush=True)
"""


def two_thread_sum(rank, world):
    torch.set_num_threads(2)
    total = float(torch.ones(4_000_000, dtype=torch.float64).exp_().sum())
    return abs(total - 4_000_000 * math.e) < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ranks_of_a_parent_with_an_openmp_pool_do_not_hang():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "ops")])}
    proc = subprocess.run([sys.executable, "-c", _PARENT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    out = proc.stdout + proc.stderr
    assert "parent native threads: []" not in out, out[-3000:]       # the case happened: the parent had a pool
    assert proc.returncode == 0 and "result [True, True]" in proc.stdout, out[-3000:]
    assert "so the ranks are spawned" in proc.stderr, out[-3000:]


def sleep_in_rank(rank, world):
    time.sleep(60)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_timed_out_job_prints_where_each_rank_waits(capfd):
    """A multi-rank job past its timeout has each live rank print its threads' Python stacks before it is killed
    (a hang on NCCL, e.g. a peer killed mid-save, otherwise leaves only 'exceeded N s'). 15 s: spawned ranks (a
    parent with native threads, a loaded CI machine) are up and listening by then."""
    with pytest.raises(TimeoutError, match="exceeded 15 s"):
        run_distributed(sleep_in_rank, 2, timeout=15)
    err = capfd.readouterr().err
    assert err.count('in sleep_in_rank') == 2, err[-2000:]
