"""Mutation check: each mutation in MUTATIONS breaks one line of a *copy* of fsdpzero/ (and ops/) and runs the tests that must
catch it; every mutation has to make one of them fail. .ci/run runs it after the test suite.

    .venv/bin/python tests/mutation/run.py                 # all, a table and a JSON summary
    .venv/bin/python tests/mutation/run.py clip_off ga_div  # some, by name
    .venv/bin/python tests/mutation/run.py --list

The working tree is never written: the package is copied to a temp dir, the mutation applied there (its anchor text
must occur exactly once, so a refactor that moves the line fails loudly here instead of testing nothing), and pytest
runs in a child process that imports the copy before pytest starts (sys.modules then holds the copy, so the repo
root that pytest puts first on sys.path cannot shadow it; forked ranks inherit it; PYTHONPATH names it first for
any other child). Each child runs with -x: the first failing test is the catch. A mutation that leaves its tests
green, breaks collection, or whose anchor is not found fails this script (exit 1).

The catching tests passed unmutated in the suite run just before this one (.ci/run); `--baseline` reruns them
unmutated first, to check a new entry.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str                 # the bug it plants, in words
    file: str                 # relative to fsdpzero/; fsdpzero_ops/... is relative to ops/
    old: str                  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]    # pytest node ids, run in this order with -x


PARITY = "tests/engine/test_engine_parity.py::test_matches_unsharded"
ORACLE = "tests/engine/test_oracle_deepspeed.py"

STAGE1 = "tests/optim/test_stage1_engine.py"

MUTATIONS = [
    Mutation("clip_off", "gradient clipping never engages", "optim/grad_path.py",
             "    if max_norm <= 0:\n", "    if True:\n",
             (f"{PARITY}[llama-stage3-gas4]",)),
    Mutation("ga_division_dropped", "the loss is not divided by gradient_accumulation_steps", "engine.py",
             "scaled = loss / gas if gas > 1 else loss", "scaled = loss",
             (f"{PARITY}[llama-stage3-gas4]",)),
    Mutation("scheduler_step_dropped_deferred", "no LR scheduler step (the device-side overflow verdict branch)",
             "engine.py", "                self.lr_scheduler.step()         # optimistic",
             "                pass  # self.lr_scheduler.step()",
             ("tests/engine/test_engine_fp16.py",)),
    Mutation("scheduler_step_dropped_host", "no LR scheduler step (the host-side overflow verdict branch)",
             "engine.py", "                self.lr_scheduler.step()\n        if self.loss_scaler",
             "                pass\n        if self.loss_scaler",
             (f"{ORACLE}::test_matches_deepspeed[z0_sgd_ga4_clip_some]",)),
    Mutation("scheduler_step_dropped_trainer", "no LR scheduler step when HF's Trainer drives the optimizer",
             "hf/trainer.py", "            self.scheduler.step()\n", "            pass\n",
             ("tests/hf/test_trainer_oracle.py",)),
    Mutation("fsdp_reduce_sum", "gradients summed instead of averaged across ranks (FSDP2 blocks)", "sharding.py",
             "fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy, offload_policy=offload)\n",
             "fully_shard(block, mesh=mesh, reshard_after_forward=raf, mp_policy=mp_policy, "
             "offload_policy=offload).set_gradient_divide_factor(1.0)\n",
             (f"{PARITY}[llama-stage2-gas1]",)),
    Mutation("stage1_reduce_sum", "stage 1 gradients summed instead of averaged across ranks",
             "fsdpzero_ops/stage1/optimizer.py",
             "pack(buf[:, s.offset - run.lo: s.offset - run.lo + s.chunk], self._flat_grad(s), 1.0 / self.world)",
             "pack(buf[:, s.offset - run.lo: s.offset - run.lo + s.chunk], self._flat_grad(s), 1.0)",
             (f"{STAGE1}::test_stage1_matches_reference[llama-adamw-gas4]",)),
    Mutation("offload_clip_ignored", "the CPU-offload step ignores the clip (and unscale) factor", "offload/path.py",
             "self._factor = self._factor * factor", "self._factor = self._factor",
             ("tests/offload/test_offload.py::test_offload_matches_fsdp_fp32[staged-2-1.0-False]",)),
    Mutation("fsdp_step_skipped", "the optimizer never steps on the FSDP path (stages 0/2/3)", "optim/grad_path.py",
             "    def step(self, found_inf: torch.Tensor | None = None) -> None:\n        step_unless(",
             "    def step(self, found_inf: torch.Tensor | None = None) -> None:\n        return\n        step_unless(",
             (f"{PARITY}[llama-stage3-gas1-dtypebfloat16]",)),
    Mutation("stage1_step_skipped", "stage 1's update_params does nothing", "fsdpzero_ops/stage1/optimizer.py",
             "        factor, self._grad_factor = self._grad_factor, None\n", "        return\n",
             (f"{STAGE1}::test_stage1_matches_reference[llama-bf16]",)),
    Mutation("cpu_offload_step_skipped", "the CPU-offload optimizer never steps a chunk", "offload/path.py",
             "                self.optimizer.step_param(e.master, grad, out=out,",
             "                continue; self.optimizer.step_param(e.master, grad, out=out,",
             ("tests/offload/test_offload.py::test_offload_bf16_shards_fp32_masters",)),
    Mutation("nvme_step_skipped", "the NVMe optimizer never steps", "offload/nvme_path.py",
             "        self.optimizer.step(grad_scale=factor, grads=grads, hyper=self._hyper)",
             "        pass  # self.optimizer.step(grad_scale=factor, grads=grads, hyper=self._hyper)",
             ("tests/offload/test_nvme.py::test_offload_path_nvme_equals_cpu[staged-float32-False]",)),
    Mutation("unscale_skipped_deferred", "fp16 grads not divided by the loss scale (device-side verdict branch)",
             "engine.py", "path.scale_grads_(factor / scale if unscale else factor)", "path.scale_grads_(factor)",
             (f"{PARITY}[llama-stage2-gas2-fp16static]",)),
    Mutation("unscale_skipped_host", "fp16 grads not divided by the loss scale (host-side verdict branch)",
             "engine.py", "                factor = factor / scale\n", "                factor = factor\n",
             (f"{PARITY}[llama-stage2-gas2-fp16static-hostverdict]",)),
    Mutation("master_cast_stage1", "stage 1's fp32 masters taken rounded to bf16", "fsdpzero_ops/stage1/layout.py",
             ".copy_(s.param.detach().view(-1)[start: start + s.local])",
             ".copy_(s.param.detach().view(-1)[start: start + s.local].to(torch.bfloat16))",
             (f"{STAGE1}::test_stage1_matches_reference[llama-bf16]",)),
    Mutation("master_cast_offload", "CPU offload's separate fp32 masters taken rounded to bf16", "offload/prepare.py",
             'master = local.detach().to("cpu", torch.float32, copy=True)',
             'master = local.detach().to("cpu", torch.bfloat16, copy=True).float()',
             ("tests/offload/test_offload.py::test_offload_matches_fsdp_fp32[staged-1-0.0-False]",)),
    Mutation("ckpt_load_skips_optimizer", "load_checkpoint leaves the optimizer state out", "engine.py",
             "load_engine(self, load_dir, tag, load_optimizer_states,", "load_engine(self, load_dir, tag, False,",
             ("tests/checkpoint/test_engine_checkpoint.py::test_exact_resume_through_engine",)),
    Mutation("muon_ns_on_shard", "Muon's Newton-Schulz runs on each rank's rows instead of the whole matrix",
             "optim/muon.py",
             '            self._add("gather", p.shape, group, (chunk, *p.shape[1:]), ns_method, make, done)\n',
             '            self._add("local", local_tensor(p).shape, None, (), ns_method, make, done)\n',
             ("tests/optim/test_muon.py::test_batched_orthogonalization_equals_per_matrix",
              "tests/optim/test_muon.py::test_muon_matches_deepspeed[2-1.0]")),
    Mutation("muon_split_takes_head", "the output head gets Muon (DeepSpeed gives it AdamW)", "optim/muon.py",
             'for word in ("embed", "lm_head")', 'for word in ("embed",)',
             ("tests/optim/test_muon.py::test_muon_matches_deepspeed[3-1.0]",)),
    Mutation("ulysses_labels_shifted_per_slice", "Ulysses shifts each rank's slice of the labels, not the whole "
             "sequence's (the token at each slice boundary is lost)", "parallel/ulysses.py",
             '        labels = torch.nn.functional.pad(batch.pop("labels"), (0, 1), value=-100)\n'
             '        batch["shift_labels"] = labels[..., 1:].contiguous()\n',
             '        labels = batch.pop("labels").reshape(*batch["input_ids"].shape[:1], sp_size, -1)\n'
             '        labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[..., 1:]\n'
             '        batch["shift_labels"] = labels.reshape(batch["input_ids"].shape).contiguous()\n',
             ("tests/parallel/test_ulysses.py::test_sp2_matches_unsharded",)),
    Mutation("user_mesh_unchecked", "a mesh passed in without a 'tp' dimension trains without tensor parallelism",
             "api.py", "        check_user_mesh(mesh, plan.tensor_parallel.size)\n", "        pass\n",
             ("tests/parallel/test_user_mesh.py",)),
    Mutation("unused_params_not_reduced", "a parameter with a gradient on some ranks only: FSDP2 reduce-scatters "
             "only the gradients each rank has", "sharding.py", "model.set_reduce_scatter_unused_params(True)",
             "model.set_reduce_scatter_unused_params(False)", ("tests/engine/test_unused_on_some_ranks.py",)),
    Mutation("tp_adapter_layer_unplanned", "a LoRA-wrapped planned layer is left whole beside sharded ones",
             "parallel/tp_plan.py", 'if spec is not None and spec.partition_type != "skip":', "if False:",
             ("tests/parallel/test_autotp.py::test_adapter_wrapped_layers_refused",)),
    Mutation("trainer_sp_loss_per_slice", "under the HF Trainer with Ulysses each rank's loss is its slice's mean",
             "hf/trainer.py", 'loss = sequence_parallel_loss(outputs.loss, inputs["shift_labels"], sp.group)',
             "loss = outputs.loss", ("tests/hf/test_trainer_ulysses.py::test_trainer_sp2_matches_unsharded",)),
    Mutation("ulysses_adapter_spent_pass", "the Ulysses adapter hands the next epoch a spent pass (the HF Trainer "
             "loses one optimizer step an epoch, as with DeepSpeed's adapter)", "parallel/ulysses.py",
             "        if not self.micro_batches and self.peeked is None", "        if False and self.peeked is None",
             ("tests/hf/test_trainer_ulysses.py::test_trainer_sp2_matches_unsharded",)),
]


def source(root: Path, file: str) -> Path:
    """A mutation's file under a checkout (the repo or the copy): the library's in fsdpzero/, the ops' in ops/."""
    return root / ("ops" if file.startswith("fsdpzero_ops/") else "fsdpzero") / file


def shown(file: str) -> str:
    return str(source(Path(), file))


def apply(mutation: Mutation, root: Path) -> None:
    path = source(root, mutation.file)
    text = path.read_text()
    n = text.count(mutation.old)
    if n != 1:
        raise SystemExit(f"mutation {mutation.name}: its anchor occurs {n} times in {shown(mutation.file)} (must "
                         f"be exactly once; update the anchor in tests/mutation/run.py):\n{mutation.old!r}")
    path.write_text(text.replace(mutation.old, mutation.new))


# Imports the mutated copy before pytest runs (pytest then prepends the repo root to sys.path; the copy is already
# in sys.modules and its subpackages resolve through fsdpzero.__path__); the same for the ops, from the copy's ops/.
CHILD = """
import os, sys
copy = sys.argv[1]
sys.path[:0] = [copy, os.path.join(copy, "ops")]
import fsdpzero, fsdpzero_ops
assert fsdpzero.__file__.startswith(copy), fsdpzero.__file__
assert fsdpzero_ops.__file__.startswith(copy), fsdpzero_ops.__file__
import pytest
sys.exit(pytest.main(sys.argv[2:]))
"""


def run_tests(copy: Path | None, tests: tuple[str, ...], log: Path,
              extensions: Path | None = None) -> tuple[int, str | None, float]:
    """pytest -x over `tests` with the package at `copy` (None: the repo's own); the ops build under `extensions`
    (a cache shared with the repo's own runs would be rebuilt for the copy's source paths, then for the repo's)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if extensions is not None:
        env["TORCH_EXTENSIONS_DIR"] = str(extensions)
    env.pop("CI", None)   # a skip is not a catch either way; the skip policy is the suite's business
    root = str(copy) if copy is not None else str(ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.path.join(root, "ops"), env.get("PYTHONPATH")) if p)
    args = [sys.executable, "-c", CHILD, root, "-x", "-q", "-p", "no:cacheprovider", "-rfE", "--no-header", *tests]
    t0 = time.monotonic()
    with open(log, "w") as f:
        proc = subprocess.run(args, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
    elapsed = time.monotonic() - t0
    out = log.read_text()
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", out, re.M)
    return proc.returncode, failed.group(1) if failed else None, elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="run only these mutations")
    ap.add_argument("--list", action="store_true", help="list the mutations and their tests")
    ap.add_argument("--baseline", action="store_true", help="first run each mutation's tests unmutated")
    ap.add_argument("--anchors", action="store_true", help="only check that every anchor occurs exactly once")
    ap.add_argument("--json", type=Path, help="also write the JSON summary here")
    args = ap.parse_args()
    known = {m.name: m for m in MUTATIONS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        ap.error(f"unknown mutation(s) {unknown}; known: {sorted(known)}")
    todo = [known[n] for n in args.names] if args.names else MUTATIONS
    if args.list:
        for m in todo:
            print(f"{m.name:32s} {shown(m.file):37s} {m.what}\n{'':33s}tests: {' '.join(m.tests)}")
        return 0
    if args.anchors:
        for m in todo:
            n = source(ROOT, m.file).read_text().count(m.old)
            print(f"{'ok' if n == 1 else 'BAD':4s} {m.name:32s} anchor found {n} time(s) in {shown(m.file)}")
        return 0 if all(source(ROOT, m.file).read_text().count(m.old) == 1 for m in todo) else 1
    rows = []
    # One fixed place for the copy: the C++ ops JIT-build from the copy's sources, and a build keyed on the same
    # paths is reused (by later mutations and later runs) instead of redone (minutes on 2 cores) for each.
    work = Path(tempfile.gettempdir()) / f"fsdpzero-mutation-{os.getuid()}"
    copy, extensions = work / "pkg", work / "torch_extensions"
    with tempfile.TemporaryDirectory(prefix="fsdpzero_mutation_logs_") as tmp:
        tmp = Path(tmp)
        for m in todo:
            shutil.rmtree(copy, ignore_errors=True)
            for top in ("fsdpzero", "ops"):   # ops/fsdpzero_ops/csrc -> ../csrc is copied as the files
                shutil.copytree(ROOT / top, copy / top, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
            apply(m, copy)
            if args.baseline:
                rc, failed, secs = run_tests(None, m.tests, tmp / f"{m.name}.baseline.log")
                if rc != 0:
                    print((tmp / f"{m.name}.baseline.log").read_text()[-3000:])
                    raise SystemExit(f"baseline: the tests of {m.name} fail unmutated (rc {rc}, {failed})")
            rc, failed, secs = run_tests(copy, m.tests, tmp / f"{m.name}.log", extensions)
            caught = rc == 1 and failed is not None
            row = dict(mutation=m.name, file=shown(m.file), what=m.what, caught=caught, caught_by=failed,
                       pytest_rc=rc, seconds=round(secs, 1))
            rows.append(row)
            print(f"{'caught ' if caught else 'MISSED '} {m.name:32s} {secs:6.1f} s  {failed or '-'}", flush=True)
            if not caught:
                print((tmp / f"{m.name}.log").read_text()[-4000:], flush=True)
    total = sum(r["seconds"] for r in rows)
    print("\n| mutation | file | caught by | time (s) |\n|---|---|---|---|")
    for r in rows:
        caught_by = r["caught_by"] if r["caught"] else f"MISSED (rc {r['pytest_rc']})"
        print(f"| {r['mutation']} | {r['file']} | {caught_by} | {r['seconds']} |")
    summary = dict(mutations=rows, caught=sum(r["caught"] for r in rows), total=len(rows), seconds=round(total, 1))
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    missed = [r["mutation"] for r in rows if not r["caught"]]
    if missed:
        print(f"mutations not caught: {missed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
