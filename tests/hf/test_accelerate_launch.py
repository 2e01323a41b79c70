"""accelerate users through `fsdpzero launch`, as they would type it: the YAML `accelerate config` writes for DeepSpeed
(`--config_file`), checked against accelerate's own launcher (the ACCELERATE_* variables `accelerate launch` gives
the ranks for the same YAML); the unchanged accelerate loop run by `fsdpzero launch --config_file` on 2 gloo ranks
with DeepSpeed hidden from every process (the issue's `DeepSpeed is not installed` is what the same launch without
the shim still gets), matching real DeepSpeed's run of the same config; bad YAML is one line naming the key."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fsdpzero.compat.accelerate_config import read_accelerate_config

ROOT = Path(__file__).resolve().parents[2]
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]
SCRIPT = str(Path(__file__).with_name("accelerate_loop.py"))

# the YAML `accelerate config` writes (accelerate 1.x, DeepSpeed, inline), and the file-based variant
INLINE = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 0.5
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero3_save_16bit_model: true
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
enable_cpu_affinity: false
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
FILE = """\
compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: {ds}
  deepspeed_multinode_launcher: standard
distributed_type: DEEPSPEED
machine_rank: 0
num_machines: 1
num_processes: 2
"""
MULTINODE = """\
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 3
  zero3_init_flag: true
  offload_param_device: cpu
mixed_precision: fp16
num_machines: 2
num_processes: 8
machine_rank: 1
main_process_ip: 10.0.0.1
main_process_port: 29555
"""


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")
           and not k.startswith("ACCELERATE_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **extra}


def _accelerates_env(path: str) -> dict:
    """What `accelerate launch --config_file path` puts in each rank's environment (its own functions)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env
    args = launch_command_parser().parse_args(["--config_file", path, "train.py"])
    args, defaults, mp_from_config = _validate_launch_command(args)
    fields = list(defaults.deepspeed_config.keys()) + (["mixed_precision"] if mp_from_config else [])   # as
    args.deepspeed_fields_from_accelerate_config = ",".join(fields)                      # launch_command does
    _, env = prepare_deepspeed_cmd_env(args)
    return {k: v for k, v in env.items() if k.startswith("ACCELERATE_") and os.environ.get(k) != v}


@pytest.mark.parametrize("yaml_text", [INLINE, FILE, MULTINODE], ids=["inline", "file", "multinode"])
def test_config_file_sets_what_accelerate_launch_sets(tmp_path, monkeypatch, yaml_text):
    for k in [k for k in os.environ if k.startswith("ACCELERATE_")]:
        monkeypatch.delenv(k)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    path = tmp_path / "acc.yaml"
    path.write_text(yaml_text.format(ds=ds))
    ours = read_accelerate_config(str(path))
    theirs = _accelerates_env(str(path))
    assert {k: v for k, v in ours.env.items() if k != "ACCELERATE_CONFIG_DS_FIELDS"} == \
        {k: v for k, v in theirs.items() if k != "ACCELERATE_CONFIG_DS_FIELDS"}
    assert ours.env["ACCELERATE_CONFIG_DS_FIELDS"] == theirs["ACCELERATE_CONFIG_DS_FIELDS"]
    if yaml_text is MULTINODE:
        assert ours.flags == {"num_gpus": 4, "num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.1",
                              "master_port": 29555}
    else:
        assert ours.flags == {"num_gpus": 2}
    assert {r[2] for r in ours.rows} <= {"mapped", "noop"} and len(ours.rows) >= 5


def test_multinode_config_is_a_torchrun_rendezvous(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(MULTINODE)
    p = subprocess.run([*FSDPZERO, "launch", "--config_file", str(path), "--dry_run", "train.py", "a"], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    cmd = p.stdout.strip().splitlines()[-1]
    assert "--nnodes 2 --nproc-per-node 4 --node-rank 1 --master-addr 10.0.0.1 --master-port 29555" in cmd, cmd
    assert "--local_rank" not in cmd         # accelerate launch passes none: accelerate scripts do not parse it
    assert f"accelerate config {path}: 10 keys: 10 mapped, 0 noop" in p.stderr, p.stderr


def test_command_line_flags_win_over_the_config_file(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(INLINE)
    p = subprocess.run([*FSDPZERO, "launch", "--config_file", str(path), "--num_gpus", "1", "--dry_run", "train.py"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    cmd = p.stdout.strip().splitlines()[-1]
    assert "--nproc-per-node 1" in cmd and "ACCELERATE_DEEPSPEED_ZERO_STAGE=2" in cmd, cmd
    assert "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE=cpu" in cmd and "ACCELERATE_MIXED_PRECISION=bf16" in cmd


BAD = {
    "fsdp": ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\nnum_processes: 2\n",
             "fsdp_config = '{...}': this is accelerate's FSDP config"),
    "no section": ("distributed_type: DEEPSPEED\nnum_processes: 2\n",
                   "deepspeed_config = {}: a DeepSpeed launch needs the section"),
    "typo": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stag: 2\n",
             "unknown key 'deepspeed_config.zero_stag' for accelerate's launch config: did you mean 'zero_stage'?"),
    "multi gpu": ("distributed_type: MULTI_GPU\nnum_processes: 2\n",
                  "distributed_type = 'MULTI_GPU': fsdpzero launch runs accelerate's DeepSpeed configs"),
    "moe": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 3\n  deepspeed_moe_layer_cls_names: Mix\n",
            "deepspeed_config.deepspeed_moe_layer_cls_names = 'Mix': ZeRO-3 leaf modules are not supported"),
    "processes": ("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 2\nnum_machines: 2\nnum_processes: 3\n"
                  "main_process_ip: a\n", "num_processes = 3: the processes of all 2 machine(s)"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_config_file_is_one_line_before_anything_starts(tmp_path, case):
    text, message = BAD[case]
    path = tmp_path / "acc.yaml"
    path.write_text(text)
    p = subprocess.run([*FSDPZERO, "launch", "--config_file", str(path), "train.py"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdpzero launch: error: --config_file {path}: "), lines
    assert message in lines[0], lines[0]


# A process in which DeepSpeed is not installed, as far as Python can tell: imports of deepspeed* fail and
# importlib.metadata finds no deepspeed distribution. Installed in every rank through sitecustomize.
HIDE_DEEPSPEED = textwrap.dedent("""\
    import importlib.machinery, importlib.metadata, sys

    class HideDeepSpeed:
        \"\"\"The path finder, blind to deepspeed (finders put before it, fsdpzero's shim, still serve it).\"\"\"
        def __init__(self, finder):
            self.finder = finder
        def find_spec(self, name, path=None, target=None):
            if name == "deepspeed" or name.startswith("deepspeed."):
                return None
            return self.finder.find_spec(name, path, target)
        def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
            return (d for d in self.finder.find_distributions(context) if d.metadata["Name"] != "deepspeed")
        def invalidate_caches(self):
            self.finder.invalidate_caches()

    sys.meta_path[:] = [HideDeepSpeed(f) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
""")


@pytest.fixture
def no_deepspeed(tmp_path) -> dict:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_DEEPSPEED)
    return _env(PYTHONPATH=f"{site}{os.pathsep}{ROOT}")


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.timeout(900)
def test_accelerate_loop_under_launch_config_without_deepspeed(tmp_path, tmp_path_factory, no_deepspeed):
    from tests.hf import test_accelerate_oracle as oracle
    probe = subprocess.run([sys.executable, "-c", "import importlib.util, importlib.metadata as m\n"
                            "print(importlib.util.find_spec('deepspeed'))\ntry: m.version('deepspeed')\n"
                            "except m.PackageNotFoundError: print('no metadata')"],
                           env=no_deepspeed, capture_output=True, text=True, timeout=60)
    assert probe.stdout.split() == ["None", "no", "metadata"], probe   # the hiding works

    model = oracle._model_dir(tmp_path_factory)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(oracle.CASES["stage2"][0]))
    config = tmp_path / "acc.yaml"
    config.write_text(FILE.format(ds=ds))
    # without the shim: accelerate finds no DeepSpeed (its utils then lack DummyOptim; Accelerator(deepspeed_plugin=)
    # raises the "DeepSpeed is not installed")
    p = subprocess.run([*FSDPZERO, "launch", "--config_file", str(config), "--no_shim", SCRIPT, model,
                        str(tmp_path / "plain")], cwd=tmp_path, env=no_deepspeed, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0 and ("DeepSpeed is not" in p.stderr or "cannot import name 'DummyOptim'" in p.stderr), \
        p.stderr[-3000:]
    # the same command with the shim: trains, and matches real DeepSpeed's run of this config
    out = tmp_path / "ours"
    p = subprocess.run([*FSDPZERO, "launch", "--config_file", str(config), SCRIPT, model, str(out)], cwd=tmp_path,
                       env=no_deepspeed, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-5000:]
    ours = torch.load(out / "result.pt", weights_only=True)
    assert ours["unwrapped"] == "FSDPLlamaForCausalLM"
    theirs, _ = oracle._run("deepspeed", "stage2", tmp_path_factory)
    oracle._compare(ours, theirs)


def test_stand_in_version_is_the_compat_version():
    from fsdpzero.compat.shim import STAND_IN_VERSION
    from fsdpzero.config.schema import COMPAT_VERSION
    assert STAND_IN_VERSION == f"{COMPAT_VERSION}+fsdpzero"


@pytest.mark.slow
@pytest.mark.oracle
@pytest.mark.timeout(900)
def test_accelerate_launch_itself_with_the_bootstrap_module(tmp_path, tmp_path_factory):
    """docs/accelerate_trl.md: where DeepSpeed is installed (accelerate's launcher imports it), `accelerate launch
    --config_file ds.yaml -m fsdpzero.compat.bootstrap train.py` trains on fsdpzero: the same numbers as DeepSpeed."""
    from tests.hf import test_accelerate_oracle as oracle
    model = oracle._model_dir(tmp_path_factory)
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(oracle.CASES["stage2"][0]))
    config = tmp_path / "acc.yaml"
    config.write_text(FILE.format(ds=ds))
    out = tmp_path / "ours"
    p = subprocess.run([str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file", str(config),
                        "-m", "fsdpzero.compat.bootstrap", SCRIPT, model, str(out)], cwd=tmp_path,
                       env=_env(DS_ACCELERATOR="cpu"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-5000:]
    ours = torch.load(out / "result.pt", weights_only=True)
    assert ours["unwrapped"] == "FSDPLlamaForCausalLM"     # fsdpzero's engine, not DeepSpeed's
    theirs, _ = oracle._run("deepspeed", "stage2", tmp_path_factory)
    oracle._compare(ours, theirs)
