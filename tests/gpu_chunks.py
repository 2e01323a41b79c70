"""`pytest -m gpu` in chunks that each fit one device call (10 minutes) with room to spare, run one after another or
in parallel lanes on disjoint GPUs of one host. Each chunk is one pytest process over a few files; a `-k` expression
splits the files whose cases need 4 GPUs (ids and names with `4gpu`) from those that need 1 or 2.

    python tests/gpu_chunks.py --list                          # chunks, GPUs each, files, and the pytest command
    python tests/gpu_chunks.py engine fp16 --out out/gpu       # these chunks, one after another, on the visible GPUs
    python tests/gpu_chunks.py --all --lanes 2 --out out/gpu   # every chunk; 1-2 GPU chunks in lanes of 2 GPUs
    python tests/gpu_chunks.py --check                         # CPU: every `-m gpu` test is in exactly one chunk

The whole suite on a 4-GPU host in four device calls, each well under 10 minutes (chunk minutes from S11, 4x H200,
and S10, one H100; with `--lanes 2`, two 1-2 GPU chunks at a time):

    bash bench/gpu_suite.sh --deepspeed -- --lanes 2 parity parity_offload optim checkpoint                # ~7.6 min
    bash bench/gpu_suite.sh --deepspeed -- --lanes 2 engine fp16 agreement hf golden offload zenflow_muon  # ~5.5
    bash bench/gpu_suite.sh --deepspeed -- engine4 hf4                                                     # ~5.5
    bash bench/gpu_suite.sh --deepspeed -- ranks4                                                          # ~3.7

On a 2-GPU host, the 4-GPU chunks skip; the others in four calls of chunks one after another (parity /
parity_offload optim / checkpoint zenflow_muon engine / fp16 agreement hf golden offload).

Chunks run in the order given. With `--lanes 2` on a 4-GPU host, consecutive 1- and 2-GPU chunks run two at a time
on GPUs 0,1 and 2,3 (CUDA_VISIBLE_DEVICES; a 1-GPU chunk sees one); a 4-GPU chunk runs alone on all four. Per
chunk, `<out>/<chunk>.log` (pytest -v with --durations) and `<out>/<chunk>.xml` (JUnit); `<out>/summary.jsonl` grows
as chunks end; at the end `<out>/summary.json` and a table: passed, failed, skipped, errors, wall seconds. A chunk
that outruns --chunk-timeout is killed and counted as timed out; the others go on. With --deadline, no chunk starts
later than that many seconds after the start, and none runs past it (fit a device call's limit; what did not run is
listed). Exit status 0 only when every chunk ran and none failed, errored or timed out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Chunk:
    name: str
    gpus: int                 # GPUs it uses (its tests skip with fewer visible)
    paths: tuple[str, ...]
    k: str | None = None      # pytest -k expression
    needs: str = ""           # what it needs beyond the GPU image's packages
    minutes: float = 0.0      # wall minutes measured (BENCHMARKS.md "GPU test runs", S11: 4x H200; parity: S10, H100)

    def selection(self) -> list[str]:
        return [*self.paths, *(["-k", self.k] if self.k else [])]

    def command(self, python: str = "python") -> list[str]:
        return [python, "-m", "pytest", "-m", "gpu", "-v", "-p", "no:cacheprovider", "--durations=0",
                *self.selection()]


FOUR = "4gpu"
CHUNKS = [
    Chunk("engine", 2, ("tests/engine/test_gpu_engine.py",), f"not {FOUR}", minutes=2.0),
    Chunk("fp16", 2, ("tests/engine/test_gpu_fp16.py",), f"not {FOUR}", minutes=1.9),
    Chunk("agreement", 2, ("tests/engine/test_rank_agreement_gpu.py",), f"not {FOUR}", minutes=1.2),
    Chunk("golden", 2, ("tests/engine/test_gpu_golden.py",), minutes=0.8),
    Chunk("checkpoint", 2, ("tests/checkpoint/test_checkpoint_gpu.py", "tests/checkpoint/test_checkpoint_stream.py",
                            "tests/checkpoint/test_rank_killed_mid_save.py"),
          f"not {FOUR}", minutes=2.6),
    Chunk("zenflow_muon", 2, ("tests/optim/test_zenflow.py", "tests/optim/test_muon.py"), minutes=2.0),
    Chunk("optim", 2, ("tests/optim/test_stage1.py", "tests/optim/test_lamb.py", "tests/ops/test_aio.py",
                       "tests/cli/test_estimate.py"), needs="DeepSpeed (FusedLamb oracle, estimate's DeepSpeed rows)",
          minutes=2.6),
    Chunk("offload", 1, ("tests/offload", "tests/hf/test_trainer_gpu.py"), minutes=0.6),
    Chunk("hf", 2, ("tests/hf/test_launch_gpu.py",), f"not {FOUR}", minutes=1.5),
    # the loss-parity test's two halves (9.3 min together on one H100, S10; each half's minutes estimated from it)
    Chunk("parity", 1, ("tests/engine/test_gpu_loss_parity.py",), "resident", needs="DeepSpeed", minutes=4.5),
    Chunk("parity_offload", 1, ("tests/engine/test_gpu_loss_parity.py",), "offload", needs="DeepSpeed", minutes=5.0),
    Chunk("engine4", 4, ("tests/engine/test_gpu_engine.py", "tests/engine/test_gpu_fp16.py"), FOUR, minutes=3.0),
    Chunk("ranks4", 4, ("tests/engine/test_rank_agreement_gpu.py", "tests/optim/test_stage1_gpu.py",
                        "tests/checkpoint/test_checkpoint_gpu.py"), FOUR, minutes=3.7),
    Chunk("hf4", 4, ("tests/hf/test_launch_gpu.py", "tests/hf/test_accelerate_ulysses.py"), FOUR, minutes=2.5),
]
BY_NAME = {c.name: c for c in CHUNKS}


def _counts(xml: Path) -> dict:
    if not xml.exists():
        return {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    suites = ET.parse(xml).getroot()
    suites = [suites] if suites.tag == "testsuite" else list(suites)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "skipped": n["skipped"], "errors": n["errors"]}


START = time.monotonic()
DEADLINE = [float("inf")]   # seconds after START (--deadline)


def run_chunk(chunk: Chunk, out: Path, devices: list[int] | None, timeout: float) -> dict | None:
    left = DEADLINE[0] - (time.monotonic() - START)
    if left < 30:
        print(f"[gpu_chunks] {chunk.name}: not started, the deadline is near", flush=True)
        return None
    timeout = min(timeout, left)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("NCCL_NVLS_ENABLE", "0")   # never NVLink multicast (the lent hosts require it off)
    if devices is not None:   # a 1-GPU chunk sees one GPU (a Trainer in one process would take 2 for DataParallel)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, devices[:chunk.gpus]))
    xml = out / f"{chunk.name}.xml"
    cmd = chunk.command(sys.executable) + [f"--junitxml={xml}"]
    t0 = time.monotonic()
    with open(out / f"{chunk.name}.log", "w") as log:
        log.write(f"# CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES', '(all)')} {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)   # pytest and the ranks it spawned
            rc, timed_out = proc.wait(), True
    row = {"chunk": chunk.name, "gpus": chunk.gpus, "devices": devices, "rc": rc, "timed_out": timed_out,
           "wall_s": round(time.monotonic() - t0, 1), **_counts(xml)}
    with open(out / "summary.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(f"[gpu_chunks] {chunk.name}: rc {rc}{' TIMED OUT' if timed_out else ''}, {row['passed']} passed, "
          f"{row['failed']} failed, {row['skipped']} skipped, {row['errors']} errors, {row['wall_s']} s", flush=True)
    return row


def run_all(chunks: list[Chunk], out: Path, lanes: int, timeout: float) -> list[dict]:
    """In the given order: a run of consecutive chunks of <= 2 GPUs shares `lanes` disjoint GPU pairs (longest
    first, when measured); a chunk of more GPUs runs alone on all of them."""
    import torch
    lanes = max(1, min(lanes, torch.cuda.device_count() // 2))
    rows: list[dict] = []
    batch: list[Chunk] = []

    def flush():
        if lanes > 1 and len(batch) > 1:
            rows.extend(_in_lanes(batch, out, lanes, timeout))
        else:
            rows.extend(run_chunk(c, out, None, timeout) or {"chunk": c.name, "not_run": True} for c in batch)
        batch.clear()
    for c in chunks:
        if c.gpus <= 2:
            batch.append(c)
            continue
        flush()
        rows.append(run_chunk(c, out, None, timeout) or {"chunk": c.name, "not_run": True})
    flush()
    return rows


def _in_lanes(chunks: list[Chunk], out: Path, lanes: int, timeout: float) -> list[dict]:
    todo: queue.Queue = queue.Queue()
    for c in sorted(chunks, key=lambda c: -c.minutes):   # stable: the given order where nothing was measured
        todo.put(c)
    rows, lock = [], threading.Lock()

    def lane(devices):
        while True:
            try:
                c = todo.get_nowait()
            except queue.Empty:
                return
            r = run_chunk(c, out, devices, timeout)
            with lock:
                rows.append(r or {"chunk": c.name, "not_run": True})
    threads = [threading.Thread(target=lane, args=([2 * i, 2 * i + 1],)) for i in range(lanes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rows


def check() -> int:
    """Collect every chunk and the whole `-m gpu` set (CPU is enough): each gpu test in exactly one chunk."""
    def collect(args):
        res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", *args], cwd=ROOT,
                             capture_output=True, text=True)
        return [ln for ln in res.stdout.splitlines() if "::" in ln]
    everything = collect(["tests"])
    seen: dict[str, list[str]] = {}
    for c in CHUNKS:
        for nodeid in collect(c.selection()):
            seen.setdefault(nodeid, []).append(c.name)
    missing = sorted(set(everything) - set(seen))
    twice = {k: v for k, v in seen.items() if len(v) > 1}
    print(f"{len(everything)} gpu tests; in no chunk: {missing or 'none'}; in several: {twice or 'none'}")
    return 1 if missing or twice else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("chunks", nargs="*", metavar="CHUNK", help="chunks to run: " + ", ".join(BY_NAME))
    ap.add_argument("--all", action="store_true", help="every chunk")
    ap.add_argument("--list", action="store_true", help="print the chunks and their commands")
    ap.add_argument("--check", action="store_true", help="every gpu test is in exactly one chunk (collects only)")
    ap.add_argument("--lanes", type=int, default=1, help="parallel lanes of 2 GPUs for the 1-2 GPU chunks")
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "gpu_chunks")
    ap.add_argument("--chunk-timeout", type=float, default=540.0, help="seconds before a chunk is killed")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which no chunk runs")
    args = ap.parse_args()
    if args.list:
        for c in CHUNKS:
            extra = f"  [{c.needs}]" if c.needs else ""
            print(f"{c.name:11s} {c.gpus} GPU{'s' if c.gpus > 1 else ' '}  {' '.join(c.command())}{extra}")
        return 0
    if args.check:
        return check()
    unknown = [n for n in args.chunks if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown chunk {unknown[0]!r}; the chunks are: {', '.join(BY_NAME)}")
    chunks = CHUNKS if args.all else [BY_NAME[n] for n in args.chunks]
    if not chunks:
        ap.error("name chunks, or --all, --list or --check")
    args.out.mkdir(parents=True, exist_ok=True)
    DEADLINE[0] = args.deadline
    rows = run_all(chunks, args.out, args.lanes, args.chunk_timeout)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))
    print("| chunk | GPUs | passed | failed | skipped | errors | wall s |\n|---|---|---|---|---|---|---|")
    not_run = [r["chunk"] for r in rows if r.get("not_run")]
    rows = [r for r in rows if not r.get("not_run")]
    for r in rows:
        flag = " (timed out)" if r["timed_out"] else ""
        print(f"| {r['chunk']} | {r['gpus']} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['errors']} | "
              f"{r['wall_s']}{flag} |")
    if not_run:
        print(f"not run (deadline): {' '.join(not_run)}")
    bad = any(r["failed"] or r["errors"] or r["timed_out"] or r["rc"] not in (0, 5) for r in rows)
    return 1 if bad or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
