"""Opt-in per-step timeline of the offload path: knob offload_profile, FSDPZERO_OFFLOAD_PROFILE=1 (off: the path holds
None, no cost).

One JSON line per optimizer step, from rank 0, to the offload_profile_file knob's file (appended) or stderr; a file
name holding "{rank}" makes every rank write its own (the slowest rank sets the step when N ranks share a host). A
step's record starts at the first forward of the step (a forward pre-hook on the root) and ends when the CPU side of
its optimizer step is done (during the next forward in overlap mode). Host times are perf_counter seconds from that
origin; GPU times come from CUDA events, as seconds from an event recorded at the origin on the compute stream. The
events are read one step later, when they have long completed, so profiling adds no synchronisation.

Fields (seconds unless named otherwise):
    backward_end_host / backward_end_gpu   finish_gradients called / the compute stream reached it (fwd + bwd)
    grad_norm_host / grad_norm_gpu         the norm's launch cost on the host / its run time on the compute stream
    factor_sync_host                       step() waiting for the clip coefficient on the host (the one sync)
    step_return_host                       step() returned (at once with overlap)
    cpu_done_host                          the last chunk was stepped and its H2D queued
    unit_wait_host[u], unit_wait_gpu[u]    forward of unit u blocked on its chunks: host wait / compute-stream stall
    chunks[k]: numel, d2h_gpu (copy time), d2h_end_gpu, d2h_wait_host (the CPU waiting for it), adam_host,
               adam_gparam_s, adam_start_host, h2d_gpu, h2d_end_gpu
    rank, origin_host                      the writer's rank / the origin in time.monotonic() seconds (one clock
                                           for all processes of a host: ranks' records line up by it)
    threads / step_threads                 the path's threads / those the CPU step ran with
    spec_first_start_host, spec_last_end_host   the speculative worker's first chunk started / last one stepped
    spec_d2h_wait_host, spec_adam_host     its waits for the grads' D2H / its Adam time, summed over its chunks
    spec_numel, spec_committed             elements it stepped / 1.0 when the step committed them
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist


class _Ev:
    """A CUDA event, or None on CPU-only runs (GPU fields are then left out)."""

    @staticmethod
    def record(stream=None):
        if not torch.cuda.is_available():
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(stream) if stream is not None else ev.record()
        return ev


class Timeline:
    def __init__(self, threads: int, n_units: int, path: str | None = None):
        self.threads = threads
        self.n_units = n_units
        self.rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))
        per_rank = path is not None and "{rank}" in path
        self.enabled = per_rank or self.rank == 0
        self.path = path.replace("{rank}", str(self.rank)) if per_rank else path
        self.step_no = 0
        self.cur: dict | None = None     # the record of the step whose forward/backward runs now
        self.pending: list[dict] = []    # stepped records whose events are read one step later
        self.stepping: dict | None = None   # the record whose CPU step runs now (the worker's)

    # -- marks, in the order a step makes them ----------------------------------------------------------------
    def forward_start(self) -> None:
        if self.cur is not None and not self.cur.get("stepped"):
            return                          # gradient accumulation: the same step's next micro-batch
        self.cur = {"step": self.step_no, "t0": time.perf_counter(), "mono": time.monotonic(), "e0": _Ev.record(),
                    "gpu": {},
                    "host": {}, "unit_wait_host": [0.0] * self.n_units, "unit_wait_ev": [], "chunks": {}}
        self.step_no += 1

    def host(self, rec: dict | None, key: str, start: float | None = None) -> None:
        """rec[key] = now (from the origin), or the duration since `start` when given."""
        if rec is not None:
            now = time.perf_counter()
            rec["host"][key] = rec["host"].get(key, 0.0) + (now - start) if start is not None else now - rec["t0"]

    def gpu(self, rec: dict | None, key: str, stream=None) -> None:
        if rec is not None:
            rec["gpu"][key] = _Ev.record(stream)

    def unit_wait(self, unit: int, host_s: float, before, after) -> None:
        if self.cur is not None:
            self.cur["unit_wait_host"][unit] += host_s
            self.cur["unit_wait_ev"].append((unit, before, after))

    def chunk(self, rec: dict | None, k: int) -> dict:
        return {} if rec is None else rec["chunks"].setdefault(k, {"ev": {}})

    def stepped(self, step_threads: int) -> dict | None:
        """step() was called for the current record: it now belongs to the CPU step."""
        rec = self.cur
        if rec is not None:
            rec["stepped"] = True
            rec["step_threads"] = step_threads
            self.pending.append(rec)
        self.stepping = rec
        return rec

    # -- output -----------------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Write the records whose CPU step is over (their events have completed, or are waited for here)."""
        ready = [r for r in self.pending if "cpu_done_host" in r["host"]]
        self.pending = [r for r in self.pending if "cpu_done_host" not in r["host"]]
        for rec in ready:
            if self.enabled:
                self._write(self._finish(rec))

    def _finish(self, rec: dict) -> dict:
        e0 = rec["e0"]

        def at(ev):      # seconds from the origin event
            if ev is None or e0 is None:
                return None
            ev.synchronize()
            return e0.elapsed_time(ev) / 1e3

        def span(a, b):
            if a is None or b is None:
                return None
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        out = {"step": rec["step"], "rank": self.rank, "origin_host": round(rec["mono"], 6), "threads": self.threads,
               "step_threads": rec.get("step_threads"),
               **{k: round(v, 6) for k, v in rec["host"].items()}}
        g = rec["gpu"]
        out["backward_end_gpu"] = at(g.get("backward_end"))
        out["grad_norm_gpu"] = span(g.get("norm_start"), g.get("norm_end"))
        out["unit_wait_host"] = [round(w, 6) for w in rec["unit_wait_host"]]
        stall = [0.0] * self.n_units
        for unit, a, b in rec["unit_wait_ev"]:
            s = span(a, b)
            stall[unit] += s or 0.0
        out["unit_wait_gpu"] = [round(s, 6) for s in stall] if e0 is not None else None
        chunks = []
        for k in sorted(rec["chunks"]):
            c = rec["chunks"][k]
            ev = c.pop("ev")
            c["d2h_gpu"] = span(ev.get("d2h_start"), ev.get("d2h_end"))
            c["d2h_end_gpu"] = at(ev.get("d2h_end"))
            c["h2d_gpu"] = span(ev.get("h2d_start"), ev.get("h2d_end"))
            c["h2d_end_gpu"] = at(ev.get("h2d_end"))
            if c.get("adam_host"):
                c["adam_gparam_s"] = round(c["numel"] / c["adam_host"] / 1e9, 3)
            chunks.append({"chunk": k, **{n: (round(v, 6) if isinstance(v, float) else v)
                                          for n, v in c.items() if v is not None}})
        out["chunks"] = chunks
        adam = sum(c.get("adam_host", 0.0) for c in chunks)
        numel = sum(c["numel"] for c in chunks if "numel" in c)
        out["adam_host_total"] = round(adam, 6)
        out["adam_gparam_s"] = round(numel / adam / 1e9, 3) if adam else None
        out["d2h_wait_host_total"] = round(sum(c.get("d2h_wait_host", 0.0) for c in chunks), 6)
        return {k: v for k, v in out.items() if v is not None}

    def _write(self, line: dict) -> None:
        text = json.dumps(line)
        if self.path:
            with open(self.path, "a") as f:
                f.write(text + "\n")
        else:
            print("fsdpzero offload timeline: " + text, file=sys.stderr, flush=True)
