"""Rank-0 logging: the effective config and decision table once, `steps_per_print` lines, and the
`wall_clock_breakdown` timers (forward / backward / step, synchronised like DeepSpeed's so they mean wall time)."""
from __future__ import annotations

import json
import logging
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from fsdpzero.host import applied as applied_placement
from fsdpzero.plan import Plan
from fsdpzero.plan.report import NOT_MAPPED, fate_rows, fate_table, summary_line

log = logging.getLogger("fsdpzero")


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def setup_logging() -> None:
    """One stderr handler on rank 0; other ranks log warnings only (errors must not be silenced)."""
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("[fsdpzero] %(message)s"))
        log.addHandler(h)
        log.propagate = False
    log.setLevel(logging.INFO if is_rank0() else logging.ERROR)


def log_startup(plan: Plan, extra: dict) -> None:
    """One compact block on rank 0: the run's shape, the count of each fate of the keys the config set, and every
    such key that is not simply `mapped` (what a user must know differs). The effective plan as JSON and the full
    fate table of every key DeepSpeed reads are logged at DEBUG (`logging.getLogger("fsdpzero").setLevel("DEBUG")`),
    as `fsdpzero migrate --all` prints them."""
    if not is_rank0():
        return
    run = ", ".join(f"{k} {v}" for k, v in extra.items())
    lines = [summary_line(plan), run]
    placement = applied_placement()   # the offload path placed this process's CPU work (fsdpzero/host.py)
    if placement is not None and plan.offload.optimizer_device != "none":
        lines.append(f"cpu: {placement.describe()}")
    if fate_rows(plan, statuses=NOT_MAPPED):
        lines.append(fate_table(plan, statuses=NOT_MAPPED))
    log.info("\n".join(lines))
    if log.isEnabledFor(logging.DEBUG):
        log.debug("effective plan:\n%s", json.dumps({**plan.to_dict(), **extra}, indent=1, default=str))
        log.debug("every key DeepSpeed reads:\n%s", fate_table(plan, show_all=True))


def mean_over_ranks(value) -> float:
    """A per-rank loss (a tensor on the engine's device, where its group communicates; None on every rank: nan)
    averaged over all ranks, as the monitor's; every rank calls it."""
    if value is None:
        return float("nan")
    t = value.detach().float().reshape(()).clone() if torch.is_tensor(value) else torch.tensor(float(value))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
        t = t / dist.get_world_size()
    return float(t)


def count(n: int) -> str:
    """An element or parameter count a reader takes in at once: 8,192 / 3.42 M / 8.03 B (never '0.0 M')."""
    if n < 1_000_000:
        return f"{n:,}"
    return f"{n / 1e6:.2f} M" if n < 1_000_000_000 else f"{n / 1e9:.2f} B"


class Timers:
    """Accumulated wall time per phase since the last report; no-ops unless enabled."""

    def __init__(self, enabled: bool, device_type: str):
        self.enabled = enabled
        self.sync = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)
        self.total: dict[str, float] = defaultdict(float)
        self._start: dict[str, float] = {}

    def start(self, name: str) -> None:
        if self.enabled:
            self.sync()
            self._start[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        if self.enabled and name in self._start:
            self.sync()
            self.total[name] += time.perf_counter() - self._start.pop(name)

    def report(self) -> str:
        line = " | ".join(f"{k}: {v * 1000:.2f}" for k, v in self.total.items())
        self.total.clear()
        return f"time (ms) | {line}"


class StepPrinter:
    """Every `steps_per_print` optimizer steps, one line like DeepSpeed's, with samples/s since the last one."""

    def __init__(self, every: int | None, timers: Timers):
        self.every = every
        self.timers = timers
        self._t0 = time.perf_counter()
        self._samples0 = 0

    def due(self, step: int) -> bool:
        return bool(self.every) and step % self.every == 0

    def print_timers(self) -> None:
        """wall_clock_breakdown on a step without a step line: the timings alone, as DeepSpeed logs them every
        optimizer step."""
        report = self.timers.report()
        if is_rank0():
            log.info(report)

    def maybe_print(self, *, step: int, skipped: int, samples: int, loss, lr, grad_norm, loss_scale) -> None:
        if not self.due(step):
            return
        now = time.perf_counter()
        rate = (samples - self._samples0) / max(now - self._t0, 1e-9)
        self._t0, self._samples0 = now, samples
        loss_v = mean_over_ranks(loss)   # one collective and host sync, only on print steps
        if is_rank0():   # this optimizer step's loss, averaged over micro-steps and ranks (as the monitor's)
            log.info("step=%d, skipped=%d, loss=%.6f, lr=%s, grad_norm=%.4g, loss_scale=%s, samples/s=%.2f",
                     step, skipped, loss_v, lr, float(grad_norm), loss_scale, rate)
            if self.timers.enabled:
                log.info(self.timers.report())
