"""bench/vs_deepspeed.py end to end on 2 gloo ranks (tiny model, fp32): JSON rows appear and fsdpzero's per-step
losses match a hand-written FSDP2 run with the same seed and data (rtol 1e-4: only reduction order differs)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_vs_deepspeed_cpu_smoke(tmp_path):
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench/vs_deepspeed.py"), "--matrix", "smoke", "--nproc", "2",
           "--out", str(tmp_path), "--impls", "fsdpzero", "plain_fsdp2", "--steps", "3", "--warmup", "1"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stdout + res.stderr
    ours = json.loads(next(tmp_path.glob("*__fsdpzero__n2.json")).read_text())
    plain = json.loads(next(tmp_path.glob("*__plain_fsdp2__n2.json")).read_text())
    for r in (ours, plain):
        assert r["world_size"] == 2 and r["dtype"] == "fp32" and r["tokens_per_s_per_gpu"] > 0
        assert len(r["losses"]) == 4 and r["launch_to_first_step_s"] > 0
    assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-4)
    assert ours["losses"][-1] < ours["losses"][0]   # the optimizer steps really happen
    assert "| step s |" in (tmp_path / "summary.md").read_text()


def _vs_deepspeed(tmp_path, *args, timeout=230):
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench/vs_deepspeed.py"), "--nproc", "2", "--out", str(tmp_path), *args]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stdout + res.stderr
    return {f.name.split("__n")[0]: json.loads(f.read_text()) for f in tmp_path.glob("*__*__n2.json")}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_loss_parity_offload_half_cpu_smoke(tmp_path):
    """bench/loss_parity.py as the GPU parity test's offload half runs it (`--only`, no plain stage-2 DeepSpeed row),
    on one gloo rank (tiny Llama, fp32, DeepSpeed 0.19.8 on CPU): both rows' first losses are DeepSpeed stage 2's bit
    for bit (its offload row is then the reference) and fsdpzero's curve follows DeepSpeed's (2e-6 relative; a step
    moves it ~4e-3)."""
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench/loss_parity.py"), "--out", str(tmp_path), "--steps", "3",
           "--only", "z2_bf16_ga1_off-opt", "--run-timeout", "300"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=380)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["impl"]: r for r in json.loads((tmp_path / "parity.json").read_text())["rows"]}
    assert set(rows) == {"fsdpzero", "deepspeed"}, rows
    assert all(r["first_equal_ds_z2"] and r["steps"] == 3 for r in rows.values()), rows
    assert rows["fsdpzero"]["last_loss"] < rows["fsdpzero"]["first_loss"]
    assert rows["fsdpzero"]["max_rel_gap_vs_ds"] <= 2e-6, rows


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_vs_deepspeed_issue31_compiled_cpu_smoke(tmp_path):
    """Issue 31 item 6's compiled row on 2 gloo ranks (tiny Llama, fp32, backend aot_eager): DeepSpeed and fsdpzero
    through the same config and `engine.compile()`, plain FSDP2 compiled per block; each row really compiled (graphs,
    compile time, no graph break), the three loss curves agree (rtol 1e-5; a step moves the loss ~3e-3 relative) and
    fall, and the overview line has all three. With --budget-s 0 nothing starts and the summary says so."""
    rows = _vs_deepspeed(tmp_path, "--matrix", "issue31", "--only", "z2_bf16_ga1_compiled", "--steps", "2",
                         "--warmup", "1")
    assert set(rows) == {f"z2_bf16_ga1_compiled__{i}" for i in ("fsdpzero", "deepspeed", "plain_fsdp2")}
    ours = rows["z2_bf16_ga1_compiled__fsdpzero"]
    for name, r in rows.items():
        assert r["compiled"] and r["compile_s"] > 0 and r["graph_breaks"] == 0, name
        assert r["graphs"] >= 1 and len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0], name
        assert r["losses"] == pytest.approx(ours["losses"], rel=1e-5), name
    assert ours["graphs"] == 2   # fsdpzero compiles the blocks and HF's loss (docs/engine.md)
    summary = (tmp_path / "summary.md").read_text()
    line = next(x for x in summary.splitlines() if x.startswith("| z2_bf16_ga1_compiled | 2 |"))
    assert line.count(" - ") == 0, line   # DeepSpeed, fsdpzero and plain FSDP2 columns all filled

    skipped = tmp_path / "skipped"
    assert _vs_deepspeed(skipped, "--matrix", "issue31", "--budget-s", "0") == {}
    text = (skipped / "summary.md").read_text()
    assert "not run (--budget-s spent): " in text and "z3_bf16_ga1_off-both__deepspeed__n2" in text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_vs_deepspeed_issue31_matrix_cpu_smoke(tmp_path):
    """The whole issue 31 matrix on 2 gloo ranks (tiny Llama, fp32): every row of issue 31's table runs (stages 1-3,
    compiled, the two offload rows) for each implementation that has it, every implementation's loss curve agrees
    with fsdpzero's eager stage-2 run (rtol 1e-5), and compiling changes no loss (rtol 1e-6)."""
    rows = _vs_deepspeed(tmp_path, "--matrix", "issue31", "--steps", "1", "--warmup", "1", timeout=590)
    expect = {"z1_bf16_ga1": ("fsdpzero", "deepspeed"), "z2_bf16_ga1": ("fsdpzero", "deepspeed", "plain_fsdp2"),
              "z3_bf16_ga1": ("fsdpzero", "deepspeed", "plain_fsdp2"),
              "z2_bf16_ga1_compiled": ("fsdpzero", "deepspeed", "plain_fsdp2"),
              "z2_bf16_ga1_off-opt": ("fsdpzero", "deepspeed"), "z3_bf16_ga1_off-both": ("fsdpzero", "deepspeed")}
    assert set(rows) == {f"{e}__{i}" for e, impls in expect.items() for i in impls}
    ref = rows["z2_bf16_ga1__fsdpzero"]["losses"]
    for name, r in rows.items():
        assert r["losses"] == pytest.approx(ref, rel=1e-5) and r["losses"][-1] < r["losses"][0], name
        assert r["offload"] == {"off-opt": "opt", "off-both": "both"}.get(name.split("__")[0].split("_")[-1], "none")
    for impl in ("fsdpzero", "deepspeed", "plain_fsdp2"):
        assert rows[f"z2_bf16_ga1_compiled__{impl}"]["losses"] == pytest.approx(rows[f"z2_bf16_ga1__{impl}"]["losses"],
                                                                               rel=1e-6)
    summary = (tmp_path / "summary.md").read_text()
    assert sum(x.startswith(tuple(f"| {e} | 2 |" for e in expect)) for x in summary.splitlines()) == len(expect)


@pytest.mark.timeout(120)
def test_nvme_budget_cpu_smoke(tmp_path):
    """bench/nvme_budget.py end to end on 2 gloo ranks (tiny Llama, optimizer and params on "NVMe" in tmp_path): a
    row with the memory columns, the parameter count the state bytes come from equals the real model's, losses
    fall, the swap files existed during the run and are gone after it; a budget below the process size is reported
    as "over budget" without failing the script."""
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    import common
    import nvme_budget
    from transformers import LlamaForCausalLM
    p = common.PRESETS["tiny"]
    with torch.device("meta"):
        real = sum(t.numel() for t in LlamaForCausalLM(common.llama_config(p)).parameters())
    assert nvme_budget.n_params(p) == real
    full = nvme_budget.init_rows("model.layers.0.mlp.up_proj.weight", (10, 7), slice(0, 10), torch.float32)
    part = nvme_budget.init_rows("model.layers.0.mlp.up_proj.weight", (10, 7), slice(3, 8), torch.float32)
    assert torch.equal(full[3:8], part) and 0.015 < full.std() < 0.025   # any rank's rows are the same values

    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    swap = tmp_path / "swap"
    swap.mkdir()
    cmd = [sys.executable, str(ROOT / "bench/nvme_budget.py"), "--nvme-path", str(swap), "--budget-gib", "0.05",
           "--impls", "fsdpzero", "--variants", "nvme", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads((tmp_path / "nvme__fsdpzero.json").read_text())
    assert r["status"] == "over budget" and r["max_vmhwm_gib"] > 0.05
    assert r["opt_state_gib_per_rank"] == pytest.approx(12 * real / 2 / 2**30)
    assert r["swap_disk_gib_total"] * 2**30 >= 12 * real     # optimizer states (+ params) were on disk
    assert r["disk_left_after_run_gib"] == 0 and list(swap.iterdir()) == []
    assert len(r["ranks"]) == 2 and all(k["mem"]["end"]["VmHWM"] >= k["mem"]["setup"]["VmRSS"] for k in r["ranks"])
    assert len(r["losses"]) == 3 and r["losses"][-1] < r["losses"][0] and r["step_s"] > 0
    assert "| nvme | fsdpzero | over budget |" in (tmp_path / "summary.md").read_text()


@pytest.mark.timeout(240)
def test_export_bench_cpu_smoke(tmp_path):
    """bench/export.py end to end on 2 gloo ranks (tiny Llama): one row per implementation, every output holds the
    same tensors bit for bit (the driver's own check, which a broken streamed writer fails), the table is printed
    and the outputs are removed."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench/export.py"), "--dir", str(tmp_path), "--nproc", "2", "--tiny",
           "--impls", "streamed", "in_memory"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {i: json.loads((tmp_path / f"{i}.json").read_text()) for i in ("streamed", "in_memory")}
    for r in rows.values():
        assert r["world"] == 2 and r["save_s"] > 0 and r["bytes_on_disk"] > 0 and r["rank0_peak_rss_gib"] > 0
    assert rows["streamed"]["bytes_on_disk"] == pytest.approx(rows["in_memory"]["bytes_on_disk"], abs=4096)
    assert "| streamed |" in res.stdout and "| in_memory |" in res.stdout
    assert res.stdout.count("| True |") == 2   # same tensors as the first output, both rows
    assert not (tmp_path / "streamed").exists() and not (tmp_path / "in_memory").exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hf_lora_cpu_smoke(tmp_path):
    """bench/hf_lora.py end to end on 2 gloo ranks (tiny Llama + LoRA, LLaMA-Factory's ZeRO-3 offload config):
    fsdpzero's Trainer and transformers' Trainer on DeepSpeed each write a row, their losses agree (fp32 here) and
    the ratio file is written."""
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, str(ROOT / "bench/hf_lora.py"), "--all", "--nproc", "2", "--out", str(tmp_path),
           "--steps", "2", "--warmup", "1", "--timeout", "360"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=390)
    assert res.returncode == 0, res.stdout + res.stderr
    listed = json.loads((tmp_path / "hf_lora.json").read_text())
    failed = [r for r in listed if "error" in r]   # a run that failed: its exit code and log tail
    assert not failed, failed
    rows = {r["impl"]: r for r in listed}
    assert set(rows) == {"fsdpzero", "deepspeed"}, rows
    assert rows["fsdpzero"]["trainable_params"] == rows["deepspeed"]["trainable_params"] > 0
    assert rows["fsdpzero"]["losses"] == pytest.approx(rows["deepspeed"]["losses"], rel=1e-4)
    assert json.loads((tmp_path / "hf_lora_ratios.json").read_text())["step_time_ds_over_ours"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_compile_bench_cpu_smoke(tmp_path):
    """bench/compile.py end to end on 2 gloo ranks (tiny Llama, fp32, backend aot_eager): a row per implementation;
    fsdpzero compiled equals fsdpzero eager bit for bit and the hand-written loop to 1e-4, no graph breaks, the
    compile time and the per-step overhead profile are recorded, and the table is written."""
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    impls = ["plain_eager", "plain_compiled", "fsdpzero_eager", "fsdpzero_compiled"]
    cmd = [sys.executable, str(ROOT / "bench/compile.py"), "--stages", "3", "--nproc", "2", "--out", str(tmp_path),
           "--impls", *impls, "--steps", "2", "--warmup", "1"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=590)
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {i: json.loads((tmp_path / f"z3__{i}__r0.json").read_text()) for i in impls}
    for impl, r in rows.items():
        assert r["world_size"] == 2 and len(r["losses"]) == 3 and r["step_s"] > 0, impl
        assert r["overhead"]["optimizer_host_ms"] > 0 and r["overhead"]["optimizer_aten_ops"] > 0, impl
    for impl, graphs in (("plain_compiled", 1), ("fsdpzero_compiled", 2)):   # fsdpzero: the blocks and HF's loss
        assert rows[impl]["graph_breaks"] == 0 and rows[impl]["compile_s"] > 0 and rows[impl]["graphs"] == graphs
    assert rows["fsdpzero_compiled"]["fsdpzero_compile_report"]["compiled_units"] == 2
    assert rows["fsdpzero_compiled"]["fsdpzero_compile_report"]["compiled_loss"]
    assert rows["fsdpzero_compiled"]["losses"] == rows["fsdpzero_eager"]["losses"]
    assert rows["fsdpzero_eager"]["losses"] == pytest.approx(rows["plain_eager"]["losses"], rel=1e-4)
    assert rows["plain_compiled"]["losses"] == pytest.approx(rows["plain_eager"]["losses"], rel=1e-6)
    summary = (tmp_path / "summary.md").read_text()
    assert "| fsdpzero_compiled |" in summary and "per-step overhead" in summary


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_autotp_bench_cpu_smoke(tmp_path):
    """bench/autotp.py end to end on 2 gloo ranks (tp 2 x dp 1, tiny Llama, fp32, fsdpzero only: DeepSpeed's side is
    tests/parallel/test_autotp_oracle.py): the JSON summary, a row with the tp layout and a falling loss, the table."""
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench/autotp.py"), "--nproc", "2", "--tp", "2", "--stages", "2",
           "--impls", "fsdpzero", "--steps", "2", "--warmup", "1", "--out", str(tmp_path)]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=230)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "autotp.json").read_text())
    (row,) = summary["rows"]
    assert (summary["tp"], summary["dp"], row["impl"], row["stage"]) == (2, 1, "fsdpzero", 2)
    assert len(row["losses"]) == 3 and row["losses"][-1] < row["losses"][0] and row["tokens_per_s_per_gpu"] > 0
    assert "| 2 | 2 x 1 | fsdpzero |" in (tmp_path / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trl_sft_lora_bench_cpu_smoke(tmp_path):
    """bench/trl_sft_lora.py end to end on 2 gloo ranks (tiny Llama, fp32, TRL SFTTrainer + LoRA at ZeRO-3): the same
    script through `fsdpzero launch` (the shim's stand-in) and under torchrun with DeepSpeed 0.19.8, a row each, the
    same trainable LoRA size, losses that agree (rtol 1e-4: only reduction order may differ) and fall, the table."""
    env = dict(os.environ, FSDPZERO_BENCH_CPU="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, str(ROOT / "bench/trl_sft_lora.py"), "--nproc", "2", "--steps", "2", "--warmup", "1",
           "--out", str(tmp_path), "--run-timeout", "130"]
    res = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=290)
    assert res.returncode == 0, res.stdout + res.stderr
    summary = json.loads((tmp_path / "trl_sft_lora.json").read_text())
    failed = [r for r in summary["rows"] if "error" in r]
    assert not failed, failed
    rows = {r["impl"]: r for r in summary["rows"]}
    assert "fsdpzero launch" in rows["fsdpzero"]["engine"] and "+fsdpzero" not in rows["deepspeed"]["engine"]
    for r in rows.values():
        assert r["world_size"] == 2 and r["timed_steps"] == 2 and len(r["losses"]) == 3 and r["step_s"] > 0
    assert rows["fsdpzero"]["trainable_params"] == rows["deepspeed"]["trainable_params"] > 0
    assert rows["fsdpzero"]["losses"] == pytest.approx(rows["deepspeed"]["losses"], rel=1e-4)
    assert rows["fsdpzero"]["losses"][-1] < rows["fsdpzero"]["losses"][0]
    assert summary["compare"]["max_abs_loss_diff"] < 1e-3
    assert "| fsdpzero |" in (tmp_path / "summary.md").read_text()


@pytest.mark.timeout(240)
def test_step_ops_counts_the_optimizer_paths_launches(tmp_path):
    """bench/step_ops.py on CPU: every row counted at step 5 on the 0.89 B layout's 147 tensors, JSON and table. The
    counts guard the foreach steps: ZenFlow's and Muon's engine.step() dispatch a few kernel operators per tensor
    (the column gathers and scatters, the momentum blends), not the ~12 (ZenFlow) and ~9 (Muon) per tensor of the
    per-tensor loops they replaced (S15: 1,827 and 1,370 at c546cae; 513 and 697 since)."""
    out = tmp_path / "ops.json"
    res = subprocess.run([sys.executable, str(ROOT / "bench/step_ops.py"), "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=230, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    rows = {r["row"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"adamw", "muon", "zenflow"} and "kernel ops/step" in res.stdout
    tensors = rows["adamw"]["param_tensors"]
    assert tensors == 147 and all(r["step"] == 5 and r["foreach_ops"] > 0 for r in rows.values())
    assert rows["adamw"]["kernel_ops_in_engine_step"] < 40   # torch's fused AdamW: a handful for all tensors
    assert rows["zenflow"]["kernel_ops_in_engine_step"] <= 4 * tensors, rows["zenflow"]
    assert rows["muon"]["kernel_ops_in_engine_step"] <= 6 * tensors, rows["muon"]


def _free_port() -> str:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _bench(args, *, timeout, **env):
    """Run a bench script from the repository root, one OpenMP thread; returns the finished process (rc 0 asserted)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **env)
    res = subprocess.run([sys.executable, *map(str, args)], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=timeout)
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]
    return res


def _torchrun(script, *args, timeout, **env):
    return _bench(["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", ROOT / script, *args],
                  timeout=timeout, **env)


@pytest.mark.timeout(120)
def test_autotp_dispatch_bench_cpu_smoke():
    """bench/autotp_dispatch.py (one process, 1-rank gloo tp mesh, 2 layers): both rows with every planned Linear
    (7 per layer + lm_head), fsdpzero's ParallelLinear dispatches far fewer DTensor ops than DTensor's styles (its
    point), the JSON line and the table; a --repeats that leaves no timed call is one clear line."""
    res = _bench([ROOT / "bench/autotp_dispatch.py", "--layers", "2", "--repeats", "6"], timeout=110,
                 MASTER_PORT=_free_port())
    out = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("{")))
    rows = {r["impl"]: r for r in out["rows"]}
    assert set(rows) == {"ParallelLinear", "DTensor styles"} and out["layers"] == 2
    assert all(r["linears"] == 7 * 2 + 1 and len(r["ms"]) == 2 and r["ms_per_fwd_bwd"] > 0 for r in rows.values())
    assert 0 < 3 * rows["ParallelLinear"]["dtensor_ops"] < rows["DTensor styles"]["dtensor_ops"], rows
    assert "| ParallelLinear | 15 |" in res.stdout and "| DTensor styles | 15 |" in res.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "bench/autotp_dispatch.py"), "--repeats", "5"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repeats 5: give at least 6" in bad.stderr, bad.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_ckpt_bench_cpu_smoke(tmp_path):
    """bench/ckpt.py --tiny under torchrun on 2 gloo ranks, fsdpzero and DeepSpeed 0.19.8 (ZeRO-3, DS_ACCELERATOR=cpu):
    each prints its JSON line with the save / load / 16-bit-save times of the real model's checkpoint (fsdpzero also
    the async save's blocking part and total), and removes its checkpoints; DeepSpeed's run builds no inference op."""
    sys.path.insert(0, str(ROOT / "bench"))
    import ckpt
    n = sum(p.numel() for p in ckpt.make_model(True).parameters())
    rows = {}
    for impl in ("fsdpzero", "deepspeed"):
        res = _torchrun("bench/ckpt.py", "--impl", impl, "--dir", tmp_path, "--tiny", "--repeats", "1", timeout=200,
                        DS_ACCELERATOR="cpu")
        assert "deepspeed_shm_comm_op" not in res.stdout + res.stderr   # its inference all-reduce op: ~40 s JIT
        rows[impl] = json.loads(next(x for x in res.stdout.splitlines() if x.startswith('{"impl"')))
    for impl, r in rows.items():
        assert (r["impl"], r["world"], r["params"], r["device"]) == (impl, 2, n, "cpu"), r
        assert r["ckpt_bytes"] >= 12 * n   # fp32 masters and two Adam moments at least
        assert all(r[k] > 0 and len(r["raw"][k]) == 1 for k in ("save_s", "load_s", "save_16bit_s")), r
    assert rows["fsdpzero"]["async_total_s"] >= rows["fsdpzero"]["async_blocking_s"] > 0
    assert "async_blocking_s" not in rows["deepspeed"]
    assert not any((tmp_path / impl).exists() for impl in rows)


@pytest.mark.timeout(120)
def test_ckpt_checksum_bench_cpu_smoke(tmp_path):
    """bench/ckpt_checksum.py on a 2 MiB state: the three save ways timed, the CRC-32 overhead, the load with its
    checksum verification (which raises on a mismatch), and nothing left in the directory given."""
    res = _bench([ROOT / "bench/ckpt_checksum.py", tmp_path, "--mib", "2", "--repeats", "2", "--threads", "2"],
                 timeout=110)
    lines = res.stdout.splitlines()
    assert lines[0].startswith("2 MiB, 2 writer threads,") and "median (min) of 2:" in lines[0], res.stdout
    for way in ("torch FileSystemWriter", "ChecksumWriter (CRC-32)", "fsdpzero save_checkpoint"):
        assert any(x.strip().startswith(way) and " save " in x and " ms (" in x for x in lines), (way, res.stdout)
    assert any("CRC-32 overhead:" in x for x in lines) and any("of which checksum verification" in x for x in lines)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_e2e_bench_cpu_smoke(tmp_path):
    """bench/e2e.py under torchrun on 2 gloo ranks (tiny preset, stages 2 and 3): per stage the rows plain FSDP2,
    fsdpzero, plain FSDP2 with step times and overheads; fsdpzero's losses equal the hand-written FSDP2 loop's (rtol
    1e-5: same seed, data and math; two steps move the loss ~7e-3 relative) and fall; the table is printed."""
    out = tmp_path / "e2e.json"
    res = _torchrun("bench/e2e.py", "--preset", "tiny", "--stages", "2", "3", "--steps", "2", "--warmup", "1",
                    "--json", out, timeout=230)
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and len(data["rows"]) == 6
    for stage, rows in ((2, data["rows"][:3]), (3, data["rows"][3:])):
        assert [(r["stage"], r["impl"]) for r in rows] == [(stage, "plain_fsdp2"), (stage, "fsdpzero"),
                                                           (stage, "plain_fsdp2")]
        for r in rows:
            assert r["world_size"] == 2 and r["step_s"] > 0 and r["tokens_per_s_per_gpu"] > 0, r
            assert r["loss_first"] == pytest.approx(rows[0]["loss_first"], rel=1e-5), r
            assert r["loss_last"] == pytest.approx(rows[0]["loss_last"], rel=1e-5), r
            assert r["loss_last"] < r["loss_first"], r
        assert min(r["step_overhead_pct"] for r in (rows[0], rows[2])) == 0.0
    import re
    table = [x for x in res.stdout.splitlines() if re.match(r"\s+[23] (plain_fsdp2|fsdpzero) ", x)]
    assert "step ovh %" in res.stdout and len(table) == 6, res.stdout


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_grad_paths_bench_cpu_smoke(tmp_path):
    """bench/grad_paths.py's own CPU smoke (FSDPZERO_BENCH_CPU=1, tiny Llama) with this tree given twice, ZeRO 2 and
    ZeRO 3 + both offloads: each case in each tree a row on the gradient path it names, the same losses in both
    trees (the same code) and across the two paths (rtol 1e-5), falling; the table with the ratio column and the
    loss-difference line."""
    res = _bench([ROOT / "bench/grad_paths.py", "--tree", ROOT, "--tree", ROOT, "--cases", "z2,z3_offload_both",
                  "--out", tmp_path], timeout=230, FSDPZERO_BENCH_CPU="1")
    rows = json.loads((tmp_path / "grad_paths.json").read_text())
    assert [(r["case"], r.get("grad_path")) for r in rows] == [("z2", "FSDPGradPath")] * 2 + [
        ("z3_offload_both", "OffloadGradPath")] * 2, rows
    ref = rows[0]["losses"]
    for r in rows:
        assert r["tree"] == str(ROOT) and len(r["losses"]) == 3 and r["step_s"] > 0 and r["setup_s"] > 0, r
        assert r["losses"] == pytest.approx(ref, rel=1e-5) and r["losses"][-1] < r["losses"][0], r
    assert "ratio to tree 0 |" in res.stdout and "| z3_offload_both | " in res.stdout
    assert "z2: largest loss difference between trees 0" in res.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_multinode_bench_cpu_smoke(tmp_path):
    """bench/multinode.py on CPU: two `fsdpzero launch` "nodes" of 2 gloo ranks each per run; fsdpzero's and
    DeepSpeed 0.19.8's hpZ rows and fsdpzero's MiCS row each keep rank 0's shard group on node 0, the three loss
    curves agree (rtol 1e-5; a step moves the loss ~3e-3 relative) and fall, the table and the comparison line."""
    res = _bench([ROOT / "bench/multinode.py", "--out", tmp_path, "--runs", "fsdpzero_hpz2", "deepspeed_hpz2",
                  "fsdpzero_mics2", "--steps", "1", "--warmup", "1", "--run-timeout", "120"], timeout=290,
                 FSDPZERO_BENCH_CPU="1")
    summary = (tmp_path / "summary.md").read_text()
    assert "failed" not in summary, summary + "".join(f.read_text()[-3000:] for f in tmp_path.glob("*.log"))
    rows = {n: json.loads((tmp_path / f"{n}.json").read_text()) for n in ("fsdpzero_hpz2", "deepspeed_hpz2",
                                                                         "fsdpzero_mics2")}
    ref = rows["fsdpzero_hpz2"]["losses"]
    for name, r in rows.items():
        assert (r["world_size"], r["nodes"], r["shard_group_of_rank0"], r["dtype"]) == (4, 2, [0, 1], "fp32"), r
        assert len(r["losses"]) == 2 and r["losses"][-1] < r["losses"][0] and r["step_s"] > 0, name
        assert r["losses"] == pytest.approx(ref, rel=1e-5), name
    assert rows["deepspeed_hpz2"]["deepspeed"] and rows["fsdpzero_hpz2"]["deepspeed"] is None
    assert "fsdpzero_hpz2 vs deepspeed_hpz2: max loss difference" in summary
    assert "| fsdpzero_mics2 |" in res.stdout


@pytest.mark.timeout(120)
def test_nvme_bench_cpu_smoke(tmp_path):
    """bench/nvme.py on an 8 MiB file in tmp_path (the best aio backend here, dd with O_DIRECT) and NVMeAdam's step
    on 2e5 bf16 params in 4 sub-groups: bandwidth rows for ours and dd, the ratio, the step and its per-stage times,
    12 B/param of Adam state on disk, the tables, the JSON, and the bench file removed. (--deepspeed is not run:
    DeepSpeed's async_io op needs libaio-dev and a ~5 min build.)"""
    out = tmp_path / "nvme.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    res = _bench([ROOT / "bench/nvme.py", "--dir", disk, "--size", "8M", "--block-size", "1M", "--repeat", "1",
                  "--opt-params", "2e5", "--sub-group-size", "5e4", "--steps", "2", "--json", out], timeout=110)
    r = json.loads(out.read_text())
    ours = f"ours ({r['backend']})"
    assert set(r["GBps"]) == {ours, "dd bs=1M"} and r["size"] == 8 * 2**20, r
    assert all(v["write"] > 0 and v["read"] > 0 for v in r["GBps"].values()) and r["ratio"]["read"] > 0
    opt = r["optimizer_step"]
    assert (opt["params"], opt["sub_groups"]) == (200_000, 4) and opt["swap_bytes"] >= 12 * 200_000, opt
    assert all(opt[k] > 0 for k in ("step_s", "read_s", "write_s", "max_s")), opt
    assert opt["sum_s"] == pytest.approx(opt["read_s"] + opt["compute_s"] + opt["write_s"], abs=3e-4)
    assert "ours / raw" in res.stdout and "optimizer step, states on disk" in res.stdout
    assert list(disk.iterdir()) == []


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_host_memory_cpu_smoke(tmp_path):
    """bench/host_memory.py, the measuring half of bench/nvme_budget.py: proc_status sees a 256 MiB allocation in
    VmRSS and VmHWM, disk_bytes counts what a sparse file really holds, and nvme_budget.py --checkpoint runs
    checkpoint_round_trip on 2 gloo ranks: save and load times, the checkpoint's size on disk, each with its own
    peak RSS in the row."""
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    import host_memory
    before = host_memory.proc_status()
    block = torch.ones(2**26)   # 256 MiB, touched
    after = host_memory.proc_status()
    assert after["VmRSS"] - before["VmRSS"] > 0.2 and after["VmHWM"] >= after["VmRSS"] > 0, (before, after)
    del block
    (tmp_path / "d").mkdir()
    with open(tmp_path / "d" / "sparse", "wb") as f:
        f.seek(64 * 2**20)
        f.write(b"x" * 2**20)
    assert 2**20 <= host_memory.disk_bytes(tmp_path / "d") < 4 * 2**20

    swap = tmp_path / "swap"
    swap.mkdir()
    res = _bench([ROOT / "bench/nvme_budget.py", "--nvme-path", swap, "--budget-gib", "4", "--impls", "fsdpzero",
                  "--variants", "nvme", "--steps", "1", "--warmup", "1", "--checkpoint", "--out", tmp_path],
                 timeout=170, FSDPZERO_BENCH_CPU="1")
    r = json.loads((tmp_path / "nvme__fsdpzero.json").read_text())
    assert len(r["ranks"]) == 2
    for k in r["ranks"]:
        ck = k["checkpoint"]
        assert ck["save_s"] > 0 and ck["load_s"] > 0 and ck["checkpoint_disk_gib"] * 2**30 >= 12 * r["n_params"]
        assert set(k["mem"]) >= {"setup", "end", "save", "load"} and k["mem"]["load"]["VmHWM"] > 0, k["mem"]
    assert "nvme fsdpzero checkpoint (" in res.stdout and ": save " in res.stdout
