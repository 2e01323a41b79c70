import os

# One compute thread per process unless told otherwise: the CI machine has two cores and the multi-rank tests fork
# two ranks (oversubscription was measured 37x slower). Set before torch starts its thread pools.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# The recipes are scripts run from their own folder (their modules import each other by bare name, as under
# torchrun); tests import them the same way.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
# One build cache for the run: our ops and DeepSpeed's (the oracle's CPU Adam builds once, ~135 s on 2 cores).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[1] / ".torch_extensions"))


# Under CI=true (.ci/run exports it) a skip is a failure unless its reason is one of these: things the CPU CI machine
# cannot have. A missing or broken DeepSpeed, a native op that did not build, a missing optional dependency: each
# fails the run instead of turning a test green by skipping it. The skips that remain are listed at the end.
CI_SKIPS_ALLOWED = {
    r"^needs CUDA|^needs (a|\d) (CUDA )?GPUs?$|^needs a CUDA GPU$": "GPU tests: CI is CPU-only",
    r"^CPU inductor compiles C\+\+": "inductor on CPU takes minutes: opt-in with FSDPZERO_TEST_INDUCTOR=1",
    r"^(io_uring|libaio) (is )?not usable here$": "kernel features the CI runner's kernel or seccomp may refuse",
    r"^this CPU/build has no avx512 kernel": "AVX-512 depends on the runner's CPU",
    r"^cannot mount a tmpfs here$": "needs mount rights",
}


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _ci_skip_policy(report, config) -> None:
    """Fail a skip whose reason is not allowed in CI; record the allowed ones for the summary."""
    import re
    if not (report.skipped and _ci()) or hasattr(report, "wasxfail"):
        return
    reason = _skip_reason(report)
    for pattern, why in CI_SKIPS_ALLOWED.items():
        if re.search(pattern, reason):
            config.stash.setdefault(_ALLOWED_SKIPS, []).append((report.nodeid, reason, why))
            return
    report.outcome = "failed"
    report.longrepr = (f"CI=true: skipped for a reason CI does not allow: {reason!r}. Install what it needs (the "
                       f"[test,oracle] extras, a working native-op build), or, for something a CPU CI machine cannot "
                       f"have, add the reason to CI_SKIPS_ALLOWED in tests/conftest.py")


_ALLOWED_SKIPS = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _ci_skip_policy(outcome.get_result(), item.config)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield   # a module-level importorskip skips the whole file at collection
    _ci_skip_policy(outcome.get_result(), collector.config)


def pytest_configure(config):
    if _ci():   # a native op that fails to build falls back to pure torch with a warning; in CI that is a failure
        config.addinivalue_line("filterwarnings", r"error:fsdpzero. could not build the C\+\+ op:RuntimeWarning")


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skips = config.stash.get(_ALLOWED_SKIPS, [])
    if not (_ci() and skips):
        return
    counts: dict[tuple[str, str], int] = {}
    for _, reason, why in skips:
        counts[(reason, why)] = counts.get((reason, why), 0) + 1
    terminalreporter.section("skips allowed in CI (CI_SKIPS_ALLOWED, tests/conftest.py)")
    for (reason, why), n in sorted(counts.items()):
        terminalreporter.write_line(f"{n:4d}  {reason}  [{why}]")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA: skipped (and so not counted) where there is none."""
    try:
        import torch
        have_cuda = torch.cuda.is_available()
    except ImportError:
        have_cuda = False
    if have_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _no_process_group_leaks():
    """A process group left in the pytest process is inherited by every rank forked later (they then fail to
    initialise their own, or hang tearing the inherited one down): destroy it, and fail the test that leaked it."""
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        pytest.fail("this test left a torch.distributed process group initialised in the test process")


@pytest.fixture
def one_rank_nccl(tmp_path):
    """A 1-rank cuda:nccl,cpu:gloo process group for the in-process GPU tests, destroyed after the test."""
    import torch.distributed as dist
    dist.init_process_group("cuda:nccl,cpu:gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
