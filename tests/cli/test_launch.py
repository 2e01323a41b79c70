"""`fsdpzero launch`: DeepSpeed's resource rules (checked against DeepSpeed 0.19.8's own runner functions), the
torchrun command it builds, and real launches: argv/env/exit status through torchrun, and an unchanged DeepSpeed
Trainer script (examples/hf_trainer_deepspeed.py) trained at ZeRO-3 on 2 gloo ranks and saved."""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

from fsdpzero.cli import launch

ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]   # the console script


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    launch.add_arguments(p)
    return p.parse_args(list(argv))


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", **extra)


# -- DeepSpeed's rules, with DeepSpeed as the oracle ---------------------------------------------------------------

@pytest.fixture(scope="module")
def ds_runner():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed.launcher.runner", reason="the [oracle] extra (DeepSpeed) is not installed")


def _same(ours, theirs):
    """Both succeed with the same ordered host -> slots, or both raise ValueError."""
    def call(fn):
        try:
            return "ok", [(h, list(s) if isinstance(s, list) else s) for h, s in fn().items()]
        except ValueError:
            return "ValueError", None
    a, b = call(ours), call(theirs)
    assert a == b, (a, b)
    return a


HOSTFILES = {
    "plain": "worker-0 slots=4\nworker-1 slots=2\n",
    "comments and blanks": "# the cluster\n\nworker-0 slots=4   # GPU box\n   \nworker-1 slots=8\n",
    "duplicate host": "worker-0 slots=4\nworker-0 slots=2\n",
    "bad entry": "worker-0 slots=4\nworker-1 4\n",
    "spaces around =": "worker-0 slots = 4\n",
    "only comments": "# nothing\n\n",
    "trailing text": "worker-0 slots=4x extra\n",
    "zero slots": "worker-0 slots=0\nworker-1 slots=1\n",
}


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(HOSTFILES))
def test_hostfile_parsing_matches_deepspeed(ds_runner, tmp_path, name):
    path = tmp_path / "hostfile"
    path.write_text(HOSTFILES[name])
    _same(lambda: launch.read_hostfile(str(path)), lambda: ds_runner.fetch_hostfile(str(path)))


def test_hostfile_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="worker-0 is listed twice"):
        launch.parse_hostfile(HOSTFILES["duplicate host"].splitlines())
    with pytest.raises(ValueError, match="bad entry 'worker-1 4'"):
        launch.parse_hostfile(HOSTFILES["bad entry"].splitlines())
    with pytest.raises(ValueError, match="--hostfile .*: no such file"):
        launch.read_hostfile(str(tmp_path / "missing"))


_HOSTS = ["worker-0", "worker-1", "worker-2"]
_node = st.builds(lambda h, s: h + (":" + ",".join(map(str, s)) if s is not None else ""),
                  st.sampled_from(_HOSTS + ["ghost"]), st.none() | st.lists(st.integers(0, 4), min_size=1, max_size=3))
_spec = st.one_of(st.just(""), st.lists(_node, min_size=1, max_size=3).map("@".join),
                  st.sampled_from(["worker-0:", "worker-0:a", "worker-0:1:2", "@", "worker-0@", ":1"]))


@pytest.mark.oracle
@settings(max_examples=300, deadline=None)
@given(slots=st.lists(st.integers(0, 4), min_size=1, max_size=3), include=_spec, exclude=_spec,
       num_nodes=st.sampled_from([-1, 1, 2]), num_gpus=st.sampled_from([-1, 1, 3]))
def test_include_exclude_and_trimming_match_deepspeed(ds_runner, slots, include, exclude, num_nodes, num_gpus):
    pool = collections.OrderedDict(zip(_HOSTS, slots))
    status = _same(lambda: launch.filter_resources(pool, include, exclude),
                   lambda: ds_runner.parse_inclusion_exclusion(pool, include, exclude))
    if status[0] == "ok":
        active = launch.filter_resources(pool, include, exclude)
        assert launch.trim_resources(active, num_nodes, num_gpus) == \
            ds_runner.apply_num_nodes_and_gpus(collections.OrderedDict(active), num_nodes, num_gpus)


@pytest.mark.oracle
@pytest.mark.parametrize("include,exclude", [
    ("worker-0:0,2@worker-1", ""), ("", "worker-1:0"), ("worker-1@worker-0", ""), ("worker-0@worker-0:1", ""),
    ("", "worker-0@worker-1:1,0"), ("worker-0:4", ""), ("nobody", ""), ("worker-0", "worker-1"),
])
def test_readme_style_filters_match_deepspeed(ds_runner, include, exclude):
    pool = collections.OrderedDict([("worker-0", 4), ("worker-1", 2)])
    _same(lambda: launch.filter_resources(pool, include, exclude),
          lambda: ds_runner.parse_inclusion_exclusion(pool, include, exclude))


# -- the torchrun command --------------------------------------------------------------------------------------------

def test_one_machine_on_cpu():
    plan = launch.plan_launch(_args("--num_gpus", "2", "train.py", "--deepspeed", "ds.json", "--lr", "1"), None,
                              gpu_count=0, hostname="box")
    assert plan.torchrun_args == ["--nnodes", "1", "--nproc-per-node", "2", "--standalone", "--module",
                                  "fsdpzero.compat.bootstrap", "train.py", "--local_rank=${local_rank}",
                                  "--deepspeed", "ds.json", "--lr", "1"]
    assert plan.env == {}                                       # no GPUs: nothing to make visible
    assert "2 CPU processes (gloo)" in plan.summary


def test_flags_for_the_script():
    args = launch.plan_launch(_args("--no_local_rank", "--module", "pkg.train", "-x"), None, gpu_count=0,
                              hostname="box").torchrun_args
    assert args[-5:] == ["--module", "fsdpzero.compat.bootstrap", "-m", "pkg.train", "-x"]
    args = launch.plan_launch(_args("--no_shim", "t.py", "--deepspeed"), None, gpu_count=0,
                              hostname="box").torchrun_args
    assert args[-3:] == ["t.py", "--local_rank=${local_rank}", "--deepspeed"] and "--module" not in args
    args = launch.plan_launch(_args("--no_python", "./run.sh"), None, gpu_count=0, hostname="box").torchrun_args
    assert args[-3:] == ["--no-python", "./run.sh", "--local_rank=${local_rank}"]
    with pytest.raises(ValueError, match="--module and --no_python"):
        launch.plan_launch(_args("--module", "--no_python", "x"), None, gpu_count=0, hostname="box")


def test_bind_cores_to_rank_runs_each_rank_through_the_binder():
    args = launch.plan_launch(_args("--bind_cores_to_rank", "--bind_core_list", "0-7,16-23", "--num_gpus", "2",
                                    "t.py", "--x"), None, gpu_count=0, hostname="box", python="/py").torchrun_args
    assert args[5:] == ["--no-python", "/py", "-u", "-m", "fsdpzero.host", "--bind_cores_to_rank",
                        "--bind_core_list", "0-7,16-23", "--", "/py", "-u", "-m", "fsdpzero.compat.bootstrap", "t.py",
                        "--local_rank=${local_rank}", "--x"]
    args = launch.plan_launch(_args("--bind_cores_to_rank", "--no_python", "./run.sh"), None, gpu_count=0,
                              hostname="box", python="/py").torchrun_args
    assert args[5:] == ["--no-python", "/py", "-u", "-m", "fsdpzero.host", "--bind_cores_to_rank", "--", "./run.sh",
                        "--local_rank=${local_rank}"]
    with pytest.raises(ValueError, match="--bind_core_list 0-3: add --bind_cores_to_rank"):
        launch.plan_launch(_args("--bind_core_list", "0-3", "t.py"), None, gpu_count=0, hostname="box")
    with pytest.raises(ValueError, match="bad CPU list '3-0'"):
        launch.plan_launch(_args("--bind_cores_to_rank", "--bind_core_list", "3-0", "t.py"), None, gpu_count=0,
                           hostname="box")


def test_gpus_are_chosen_by_slot():
    plan = launch.plan_launch(_args("--include", "localhost:1,3", "t.py"), None, gpu_count=4, hostname="box")
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "1,3"} and plan.torchrun_args[:4] == ["--nnodes", "1",
                                                                                      "--nproc-per-node", "2"]
    # CUDA_VISIBLE_DEVICES already set and no filter: its GPUs, as DeepSpeed does
    plan = launch.plan_launch(_args("t.py"), None, gpu_count=2, hostname="box", visible="4,6")
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "4,6"}
    with pytest.raises(ValueError, match="2 visible GPU"):
        launch.plan_launch(_args("--num_gpus", "3", "t.py"), None, gpu_count=2, hostname="box")


def test_several_nodes_meet_at_the_rendezvous():
    pool = collections.OrderedDict([("node-a", 8), ("node-b", 4)])
    # found by hostname: node 1, torchrun's static rendezvous, so ranks follow the hostfile as DeepSpeed numbers them
    plan = launch.plan_launch(_args("--master_addr", "node-a", "t.py"), pool, gpu_count=8, hostname="node-b.cluster",
                              environ={"SLURM_JOB_ID": "4242"})
    assert plan.torchrun_args[:12] == ["--nnodes", "2", "--nproc-per-node", "4", "--node-rank", "1", "--master-addr",
                                       "node-a", "--master-port", "29500", "--module", "fsdpzero.compat.bootstrap"]
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"} and "world size 12" in plan.summary
    # which node we are is unknown and does not matter (same slots everywhere): c10d numbers the nodes
    plan = launch.plan_launch(_args("--master_addr", "10.0.0.1", "--master_port", "6000", "--num_gpus", "2", "t.py"),
                              pool, gpu_count=0, hostname="x", environ={})
    assert plan.torchrun_args[4:10] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:6000", "--rdzv-id",
                                        "fsdpzero-6000"]
    with pytest.raises(ValueError, match="pass --master_addr .node 0's address, e.g. --master_addr node-a"):
        launch.plan_launch(_args("t.py"), pool, gpu_count=8, hostname="node-a", environ={})
    with pytest.raises(ValueError, match="pass --node_rank"):
        launch.plan_launch(_args("--master_addr", "node-a", "t.py"), pool, gpu_count=8, hostname="elsewhere")


def test_nodes_by_num_nodes_and_node_rank_without_a_hostfile():
    plan = launch.plan_launch(_args("--num_nodes", "2", "--node_rank", "1", "--num_gpus", "2", "--master_addr", "h0",
                                    "--master_port", "7000", "t.py"), None, gpu_count=0, hostname="x", environ={})
    assert plan.torchrun_args[:10] == ["--nnodes", "2", "--nproc-per-node", "2", "--node-rank", "1", "--master-addr",
                                       "h0", "--master-port", "7000"]
    assert "node 1 (node1) of 2" in plan.summary and "world size 4" in plan.summary
    plan = launch.plan_launch(_args("--num_nodes", "2", "--node_rank", "0", "--num_gpus", "2", "--master_addr", "h0",
                                    "t.py"), None, gpu_count=4, hostname="x", environ={})
    assert plan.env == {"CUDA_VISIBLE_DEVICES": "0,1"}


@pytest.mark.parametrize("argv, pool, message", [
    (("--num_nodes", "2", "--node_rank", "2", "--master_addr", "h", "t.py"), None,
     r"--node_rank 2: the job has 2 node\(s\), so --node_rank is 0..1"),
    (("--node_rank", "5", "--master_addr", "h", "t.py"), {"a": 2, "b": 2},
     r"--node_rank 5: the job has 2 node\(s\), so --node_rank is 0..1"),
    (("--num_nodes", "2", "--node_rank", "1", "t.py"), None, r"2 nodes: pass --master_addr \(node 0's address; "),
    (("--num_nodes", "2", "t.py"), None, r"--num_nodes 2 without a --hostfile: pass --node_rank \(this node's index, "
                                         r"0..1\) on each node, or a --hostfile"),
    (("--no_ssh", "--master_addr", "a", "t.py"), {"a": 2, "b": 2}, r"--no_ssh: pass --node_rank"),
])
def test_multi_node_errors_name_the_flag_value_and_fix(argv, pool, message):
    with pytest.raises(ValueError, match=message):
        launch.plan_launch(_args(*argv), pool, gpu_count=0, hostname="x", environ={})


SRUN = {"SLURM_JOB_ID": "9", "SLURM_NNODES": "3", "SLURM_NTASKS": "3", "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[07-08,12]"}


def test_srun_one_task_per_node_maps_slurm_variables():
    plan = launch.plan_launch(_args("--num_gpus", "8", "t.py"), None, gpu_count=8, hostname="gpu12", environ=SRUN)
    assert plan.torchrun_args[:10] == ["--nnodes", "3", "--nproc-per-node", "8", "--node-rank", "2", "--master-addr",
                                       "gpu07", "--master-port", "29500"]
    assert "from SLURM: --node_rank 2, --num_nodes 3, --master_addr gpu07" in plan.summary
    # flags given win; a hostfile gives the node count
    plan = launch.plan_launch(_args("--node_rank", "0", "--master_addr", "10.1.1.1", "t.py"),
                              collections.OrderedDict([("a", 2), ("b", 2), ("c", 2)]), gpu_count=2, hostname="q",
                              environ=SRUN)
    assert plan.torchrun_args[4:8] == ["--node-rank", "0", "--master-addr", "10.1.1.1"]
    assert launch.slurm_first_host("rack[2-3]-n[05,7],cpu1") == "rack2-n05"
    assert launch.slurm_first_host("a,b[1-2]") == "a"
    # one srun task per GPU would start 8 launchers per node: refused, naming the fix
    with pytest.raises(ValueError, match=r"SLURM: 24 tasks on 3 nodes: run one `fsdpzero launch` per node "
                                         r"\(srun --ntasks-per-node=1\)"):
        launch.plan_launch(_args("t.py"), None, gpu_count=8, hostname="gpu12", environ=dict(SRUN, SLURM_NTASKS="24"))
    # a one-node allocation is one machine, as without SLURM
    plan = launch.plan_launch(_args("t.py"), None, gpu_count=2, hostname="n", environ=dict(SRUN, SLURM_NNODES="1"))
    assert "--standalone" in plan.torchrun_args


def test_deepspeeds_refusals_before_anything_starts():
    with pytest.raises(ValueError, match="cannot be combined with --include/--exclude"):
        launch.plan_launch(_args("--num_gpus", "1", "--include", "localhost:0", "t.py"), None, gpu_count=2,
                           hostname="box")
    with pytest.raises(ValueError, match="without a --hostfile: pass --node_rank"):
        launch.plan_launch(_args("--num_nodes", "2", "t.py"), None, gpu_count=2, hostname="box")


# -- real launches -----------------------------------------------------------------------------------------------------

_PROBE = """
import json, os, sys
rank = os.environ["RANK"]
with open(os.path.join(sys.argv[-1], f"rank{rank}.json"), "w") as f:
    json.dump({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in
               ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}}, f)
sys.exit(3 if rank == "1" else 0)
"""


def test_launch_runs_ranks_passes_arguments_and_exit_status(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    # `--run x`: abbreviates two of torchrun's flags (--run-path, --run_path); the script's, passed unchanged
    p = subprocess.run([*FSDPZERO, "launch", "--num_gpus", "2", str(script), "--run", "x",
                        "--deepspeed", "ds config.json", str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, p.stderr[-2000:]                  # rank 1's status, as DeepSpeed's launcher returns
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["argv"] == [f"--local_rank={rank}", "--run", "x", "--deepspeed", "ds config.json", str(tmp_path)]
        assert got["env"] == {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2",
                              "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": got["env"]["MASTER_ADDR"]}
    assert p.stderr.count("unchanged-script mode") == 1          # said once, by rank 0


_AFFINITY_PROBE = """
import json, os, sys
with open(os.path.join(sys.argv[-1], f"rank{os.environ['RANK']}.json"), "w") as f:
    json.dump({"cpus": sorted(os.sched_getaffinity(0)), "omp": os.environ.get("OMP_NUM_THREADS"),
               "argv": sys.argv[1:]}, f)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two ranks need two CPUs to be pinned apart")
def test_launch_bind_cores_to_rank_pins_ranks_apart(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(_AFFINITY_PROBE)
    p = subprocess.run([*FSDPZERO, "launch", "--num_gpus", "2", "--bind_cores_to_rank", "--no_shim", str(script),
                        str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert not set(got[0]["cpus"]) & set(got[1]["cpus"]), got     # each rank its own CPUs
    assert set(got[0]["cpus"]) | set(got[1]["cpus"]) <= os.sched_getaffinity(0)
    assert [g["omp"] for g in got] == [str(len(g["cpus"])) for g in got]   # OMP threads = the slice, as DeepSpeed
    assert got[1]["argv"] == ["--local_rank=1", str(tmp_path)]
    assert p.stderr.count("--bind_cores_to_rank:") == 1, p.stderr          # rank 0 says what it picked


def test_bind_cores_to_rank_without_enough_cpus_is_one_line_before_any_rank(tmp_path):
    """--num_gpus 8 --bind_cores_to_rank on a machine with fewer usable CPUs than ranks (as DeepSpeed's launcher,
    which needs one core a rank): the launcher says so once and starts nothing; each rank used to find out after
    torchrun had started them all (the message from several ranks, then torchrun's failure report, exit 1)."""
    script = tmp_path / "probe.py"
    script.write_text("import sys; open(sys.argv[-1] + '/ran', 'w')\n")
    ranks = len(os.sched_getaffinity(0)) + 1
    p = subprocess.run([*FSDPZERO, "launch", "--num_gpus", str(ranks), "--bind_cores_to_rank", "--no_shim",
                        str(script), str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and not (tmp_path / "ran").exists(), p.stderr[-2000:]
    from fsdpzero.host import format_cpulist
    lines = p.stderr.strip().splitlines()
    assert lines == [f"fsdpzero launch: error: --bind_cores_to_rank: {ranks} ranks cannot each have their own CPU "
                     f"among {format_cpulist(frozenset(os.sched_getaffinity(0)))}"], lines


def test_bad_flag_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "hosts").write_text("a slots=2\na slots=2\n")
    p = subprocess.run([*FSDPZERO, "launch", "--hostfile", str(tmp_path / "hosts"),
                        "x.py"], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == ["fsdpzero launch: error: hostfile: a is listed twice; give each host "
                                             "one `slots=N` line"]
    # bounds (found by review: an OverflowError traceback, and 1e8 processes planned)
    (tmp_path / "hosts").write_text("localhost slots=99999999999999999999\n")
    for flags, words in ((["--hostfile", str(tmp_path / "hosts")], "slots=99999999999999999999: at most 1024"),
                         (["--num_gpus", "100000000"], "--num_gpus 100000000: at most 1024")):
        p = subprocess.run([*FSDPZERO, "launch", *flags, "--dry_run", "x.py"], cwd=ROOT, env=_env(),
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1 and words in p.stderr, p.stderr


_SHIM_PROBE = """
import importlib, json, sys
import fsdpzero, fsdpzero.hf          # first: it subclasses the original Trainer, which the shim then replaces
import deepspeed, deepspeed.comm
import transformers
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments
from transformers.integrations import HfDeepSpeedConfig
import fsdpzero.compat.deepspeed
out = {"initialize": deepspeed.initialize is fsdpzero.compat.deepspeed.initialize
                     and deepspeed.DeepSpeedEngine.__mro__[1] is fsdpzero.Engine, "version": deepspeed.__version__,
       "trainer": issubclass(Trainer, fsdpzero.hf.Trainer) and transformers.Trainer is Trainer,
       "seq2seq": issubclass(Seq2SeqTrainer, fsdpzero.hf.Trainer), "local_rank": deepspeed.comm.get_local_rank()}
args = Seq2SeqTrainingArguments(output_dir=sys.argv[2], deepspeed={"zero_optimization": {"stage": 3}})
out["diverted"] = [args.deepspeed, args.fsdpzero_config, args.use_cpu]
dschf = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})
out["hf_deepspeed_config"] = type(dschf) is fsdpzero.hf.HfDeepSpeedConfig
del dschf
try:
    importlib.import_module("deepspeed.moe.layer")
except ModuleNotFoundError as e:
    out["ops"] = str(e)
json.dump(out, open(sys.argv[1], "w"))
"""


@pytest.mark.slow
def test_shim_inside_launch_and_real_deepspeed_outside(tmp_path):
    script = tmp_path / "shim_probe.py"
    script.write_text(_SHIM_PROBE)
    p = subprocess.run([sys.executable, "-m", "fsdpzero.compat.bootstrap", str(script), str(tmp_path / "out.json"),
                        str(tmp_path / "o")], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads((tmp_path / "out.json").read_text())
    assert got["initialize"] and got["trainer"] and got["seq2seq"] and got["version"] == "0.19.8+fsdpzero"
    assert got["diverted"] == [None, {"zero_optimization": {"stage": 3}}, True] and got["local_rank"] == 0
    assert "'deepspeed.moe'" in got["ops"] and "--no_shim" in got["ops"]
    assert got["hf_deepspeed_config"]
    # the same interpreter outside `fsdpzero launch`: DeepSpeed itself (when installed), transformers untouched
    p = subprocess.run([sys.executable, "-c", "import deepspeed, transformers; print(deepspeed.__file__, "
                        "transformers.Trainer.__module__, hasattr(transformers.TrainingArguments, "
                        "'__fsdpzero_diverted__'))"], cwd=ROOT, env=_env(DS_ACCELERATOR="cpu"),
                       capture_output=True, text=True, timeout=180)
    if p.returncode == 0:
        ds_file, module, diverted = p.stdout.split()[-3:]
        assert "site-packages" in ds_file and module == "transformers.trainer" and diverted == "False"


@pytest.mark.slow
def test_unchanged_trainer_script_zero3_on_two_ranks(tmp_path):
    """examples/hf_trainer_deepspeed.py has no fsdpzero in it; `fsdpzero launch --num_gpus 2` runs it with a
    Hugging Face ZeRO-3 config (CPU offload, "auto" everywhere) to the end, and save_model's folder loads in
    plain transformers with weights that moved from the initialisation."""
    import torch
    from transformers import AutoModelForCausalLM
    out = tmp_path / "run"
    cmd = [*FSDPZERO, "launch", "--num_gpus", "2", "examples/hf_trainer_deepspeed.py",
           "--deepspeed", "tests/ds_configs/hf_transformers_zero3.json", "--output_dir", str(out),
           "--max_steps", "4", "--logging_steps", "1"]
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "ZeRO stage 3" in p.stderr and p.stderr.count("unchanged-script mode") == 1
    assert "after 4 steps on 2 process(es) (deepspeed 0.19.8+fsdpzero)" in p.stdout
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import hf_trainer_deepspeed as ex
    finally:
        sys.path.pop(0)
    torch.manual_seed(42)                                          # TrainingArguments' default seed
    init = ex.LlamaForCausalLM(model.config)
    moved = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), init.state_dict().values()))
    assert 1e-4 < moved < 1.0, moved
    batch = torch.stack([w["input_ids"] for w in ex.byte_windows(4)])
    with torch.no_grad():
        loss, before = (m(input_ids=batch, labels=batch).loss.item() for m in (model, init))
    assert loss < before - 0.01, (loss, before)                    # 4 steps on these windows lowered their loss
    # deepspeed.zero.GatheredParameters in the script (fsdpzero.zero): the full weight, as saved
    norm = model.lm_head.weight.float().norm().item()
    assert f"lm_head.weight gathered: Parameter (256, 64), norm {norm:.6f}" in p.stdout, p.stdout[-1500:]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Using the model-agnostic default")   # the guide sets no max_new_tokens
def test_the_guides_t0_script_runs_unchanged(tmp_path):
    """The Hugging Face guide's Trainer-less ZeRO-3 inference script with its own imports
    (`from transformers.integrations import HfDeepSpeedConfig`, `import deepspeed`): under `fsdpzero launch` it runs
    on fsdpzero and each rank prints what a plain single-process model generates."""
    import torch
    from transformers import AutoModelForSeq2SeqLM, ByT5Tokenizer
    from tests.hf.test_trainerless import T0_SCRIPT, TEXTS, _t5
    lines = T0_SCRIPT.read_text().splitlines()
    original = [ln.split("# was:", 1)[1].strip() if "# was:" in ln else ln for ln in lines]
    assert "from transformers.integrations import HfDeepSpeedConfig" in original and "import deepspeed" in original
    script = tmp_path / "t0.py"
    script.write_text("\n".join(original) + "\n")
    _t5(tmp_path / "t5")
    p = subprocess.run([*FSDPZERO, "launch", "--num_gpus", "2", str(script)], cwd=ROOT,
                       env=_env(T0_MODEL=str(tmp_path / "t5")), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "unchanged-script mode" in p.stderr and "ZeRO stage 3" in p.stderr          # fsdpzero ran it
    assert "real_accelerator" not in p.stderr                                          # DeepSpeed did not
    tok, plain = ByT5Tokenizer(), AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "t5").eval()
    for rank, text in enumerate(TEXTS):
        with torch.no_grad():
            ref = plain.generate(tok.encode(text, return_tensors="pt"))
        assert f"rank{rank}:\n   in={text}\n  out={tok.decode(ref[0], skip_special_tokens=True)}" in p.stdout, \
            p.stdout[-2000:]
