"""Host memory of the offload path is touched when the path is built, not during the steps a user times (issue 31:
step times that swing, worst on a freshly started host, where a first touch of a page costs most): the speculative
step's fp32 shadows are resident once built, and the shadows released after the first steps are freed off the step's
thread."""
from __future__ import annotations

import os
import threading
import weakref

import torch

from fsdpzero.offload import speculate as spec_mod
from fsdpzero.offload.chunks import Chunk, Entry

PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def _chunks(n: int, numel: int) -> list[Chunk]:
    out = []
    for i in range(n):
        master = torch.zeros(numel)
        e = Entry(f"w{i}", torch.nn.Parameter(torch.zeros(1)), master, torch.zeros(numel, dtype=torch.bfloat16),
                  torch.zeros(numel, dtype=torch.bfloat16))
        out.append(Chunk(unit=None, entries=[e], numel=numel))
    return out


def test_shadows_are_resident_when_built():
    """Lazily allocated shadows (torch.empty) were first written by the speculative worker during the first steps
    that reached them: 3 x 32 MiB of page faults per chunk, inside a timed step (0.4 s per GiB on the development
    machine). Built resident, the RSS grows by their size at build."""
    chunks = _chunks(2, 8 << 20)               # 2 chunks, 8 M elements: 96 MiB of fp32 shadows each
    before = _rss()
    spec = spec_mod.Speculator(chunks, None, max_norm=1.0, threads=1)
    grown = _rss() - before
    fp32 = 2 * 3 * (8 << 20) * 4
    assert len(spec.covered) == 2
    assert grown >= 0.9 * fp32, f"RSS grew by {grown / 2**20:.0f} MiB, the fp32 shadows are {fp32 / 2**20:.0f} MiB"


def test_released_shadows_are_freed_off_the_steps_thread():
    """After TRIM_AFTER committed steps the shadows the worker never reached are released: freeing GiBs (munmap, 0.08
    s per GiB here) inside collect() stalled that step; a background thread frees them."""
    chunks = _chunks(3, 1 << 10)
    spec = spec_mod.Speculator(chunks, None, max_norm=1.0, threads=1)
    freed_on = []
    idle = chunks[0].entries[0].master          # forward order: the first chunk's grads land last, never reached
    for t in spec.shadow[id(idle)]:
        weakref.finalize(t, lambda: freed_on.append(threading.current_thread().name))
    del t
    reached = {id(c): None for c in chunks[1:]}
    for _ in range(spec_mod.TRIM_AFTER):
        spec._trim_unreached(reached)
    for th in threading.enumerate():
        if th.name == "fsdpzero-offload-release":
            th.join(timeout=30)
    assert id(chunks[0]) not in spec.covered and id(idle) not in spec.shadow
    assert len(freed_on) == 4 and set(freed_on) == {"fsdpzero-offload-release"}, freed_on
