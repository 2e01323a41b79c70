"""Several nodes simulated on one host: two `fsdpzero launch` processes, each a "node" of 2 gloo CPU ranks, meet as
one 4-rank job, as DeepSpeed's multi-node launcher is used (`deepspeed --hostfile h --no_ssh --node_rank k` on each
node; fsdpzero launch never ssh-es). The training script (tests/launch/ds_train.py) is one DeepSpeed script, run on
fsdpzero through the shim or on DeepSpeed 0.19.8 itself with --no_shim.

Checked: each rank's RANK / LOCAL_RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / GROUP_RANK (node k holds ranks 2k, 2k+1, as
DeepSpeed's launcher numbers them); the hpZ (zero_hpz_partition_size 2) and MiCS (mics_shard_size 2) shard groups lie
within a node, as on real hardware; the 2-node run's per-step losses equal a single 4-rank launch's; and hpZ's losses
and grad norms equal DeepSpeed's own hpZ run (fp32, TOL). MiCS: DeepSpeed 0.19.8 removed it (its config error is
asserted below), so fsdpzero's MiCS is compared with DeepSpeed's ZeRO-3 run of the same model and data (MiCS shards
within a group and replicates across groups: the same math as ZeRO-3)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.multirank import free_port

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "launch" / "ds_train.py"
FSDPZERO = [sys.executable, "-c", "import sys; from fsdpzero.cli import main; sys.exit(main())"]   # the console script
STEPS, TOL, TIMEOUT = 5, 1e-5, 400


def _config(**zero) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 8,
            "steps_per_print": 10 ** 9, "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01, "torch_adam": True}},
            # threshold 0: every block is sharded on its own (this model's blocks are below DeepSpeed's default 1e5
            # parameters, which would keep them whole on each rank, in fsdpzero's root unit: no hpZ group at all)
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero}}


def _env(**extra) -> dict:
    drop = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return dict(env, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), TOKENIZERS_PARALLELISM="false", DS_ACCELERATOR="cpu",
                TORCH_EXTENSIONS_DIR=str(ROOT / ".torch_extensions"), **extra)


def _launch(tmp: Path, name: str, config: dict, nodes: list[tuple[list[str], dict]], shim: bool = True) -> list[dict]:
    """Start one `fsdpzero launch` per node (flags, extra env) at once, wait for all; each rank's JSON, by rank."""
    out = tmp / name
    out.mkdir()
    (out / "ds.json").write_text(json.dumps(config))
    procs = [subprocess.Popen([*FSDPZERO, "launch", *flags, *([] if shim else ["--no_shim"]), str(SCRIPT),
                               "--deepspeed_config", str(out / "ds.json"), "--out", str(out), "--steps", str(STEPS)],
                              cwd=ROOT, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for flags, env in nodes]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)], logs


def _two_nodes(tmp: Path, name: str, config: dict, how: str, shim: bool = True):
    port = str(free_port())
    if how == "hostfile":        # DeepSpeed's form: a hostfile, --no_ssh and --node_rank on each node
        (tmp / f"{name}.hosts").write_text("node-a slots=2\nnode-b slots=2\n")
        nodes = [(["--hostfile", str(tmp / f"{name}.hosts"), "--no_ssh", "--node_rank", str(k), "--master_addr",
                   "127.0.0.1", "--master_port", port], {"TEST_NODE": str(k)}) for k in (0, 1)]
    elif how == "num_nodes":     # torchrun's form: --num_nodes/--node_rank, no hostfile
        nodes = [(["--num_nodes", "2", "--node_rank", str(k), "--num_gpus", "2", "--master_addr", "127.0.0.1",
                   "--master_port", port], {"TEST_NODE": str(k)}) for k in (0, 1)]
    else:                        # srun --nodes 2 --ntasks-per-node 1: SLURM's variables say node rank, count, master
        nodes = [(["--num_gpus", "2", "--master_port", port],
                  {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": str(k),
                   "SLURM_PROCID": str(k), "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "TEST_NODE": str(k)})
                 for k in (0, 1)]
    return _launch(tmp, name, config, nodes, shim)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every launch once, shared by the tests below (each launch is 4 ranks importing transformers); DeepSpeed's
    only where it is installed (the [oracle] extra)."""
    tmp = tmp_path_factory.mktemp("multinode")
    hpz, mics = _config(zero_hpz_partition_size=2), _config(mics_shard_size=2)
    runs = {
        "hpz_2nodes": _two_nodes(tmp, "hpz_2nodes", hpz, "hostfile"),
        "hpz_1node": _launch(tmp, "hpz_1node", hpz, [(["--num_gpus", "4"], {})]),
        "mics_2nodes": _two_nodes(tmp, "mics_2nodes", mics, "num_nodes"),
    }
    if importlib.util.find_spec("deepspeed") is not None:
        runs["ds_hpz_2nodes"] = _two_nodes(tmp, "ds_hpz_2nodes", hpz, "slurm", shim=False)
    return runs


def _run(runs, name):
    if name not in runs:
        pytest.skip("the [oracle] extra (DeepSpeed) is not installed")
    return runs[name]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["hpz_2nodes", "mics_2nodes", "ds_hpz_2nodes"])
def test_each_rank_knows_its_node_and_shard_groups_stay_inside_it(runs, name):
    ranks, logs = _run(runs, name)
    for r, got in enumerate(ranks):
        node, local = divmod(r, 2)
        assert got["env"] | {"MASTER_PORT": None} == {
            "RANK": str(r), "LOCAL_RANK": str(local), "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": str(node), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": None,
            "TEST_NODE": str(node)}, (name, r, got["env"])      # TEST_NODE: set on launch k only (node k's ranks)
        assert got["argv_local_rank"] == local
        group = got["groups"]["shard" if name.startswith("mics") else "hpz"]
        assert group == [2 * node, 2 * node + 1], (name, r, got["groups"])   # the node's two ranks, nobody else's
    if name == "hpz_2nodes":
        assert "node 0 (node-a) of 2, master 127.0.0.1:" in logs[0], logs[0][-2000:]
    if name == "ds_hpz_2nodes":
        assert "from SLURM: --node_rank 1, --num_nodes 2, --master_addr 127.0.0.1" in logs[1], logs[1][-2000:]


@pytest.mark.timeout(1800)
def test_two_node_launch_trains_as_one_four_rank_launch(runs):
    two, one = runs["hpz_2nodes"][0], runs["hpz_1node"][0]
    assert all(r["losses"] == two[0]["losses"] for r in two)
    for step, (a, b) in enumerate(zip(two[0]["losses"], one[0]["losses"])):
        assert abs(a - b) <= 1e-6, f"step {step}: 2 nodes {a} vs 1 node {b}"
    assert one[0]["groups"]["hpz"] == [0, 1] and one[3]["groups"]["hpz"] == [2, 3]


@pytest.mark.oracle
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("name", ["hpz_2nodes", "mics_2nodes"])
def test_hpz_and_mics_match_deepspeed_on_two_nodes(runs, name):
    ours, theirs = runs[name][0][0], _run(runs, "ds_hpz_2nodes")[0][0]
    assert ours["library"] == "fsdpzero" and theirs["library"] == "deepspeed"
    assert len(ours["losses"]) == len(theirs["losses"]) == STEPS
    for step in range(STEPS):
        a, b = theirs["losses"][step], ours["losses"][step]
        assert abs(a - b) <= TOL, f"{name} step {step} loss: deepspeed {a} vs fsdpzero {b}"
        a, b = theirs["norms"][step], ours["norms"][step]
        assert abs(a - b) <= TOL * max(1.0, a), f"{name} step {step} grad norm: deepspeed {a} vs fsdpzero {b}"


@pytest.mark.oracle
def test_deepspeed_0_19_8_refuses_mics():
    """DeepSpeed 0.19.8 removed MiCS: its config parser refuses mics_shard_size (so its own MiCS cannot run here, on
    CPU or GPU); fsdpzero carries it as HSDP (docs/launch.md)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed", reason="the [oracle] extra (DeepSpeed) is not installed")
    from deepspeed.runtime.config import DeepSpeedConfig, DeepSpeedConfigError
    with pytest.raises(DeepSpeedConfigError, match="MiCS ZeRO-3 sharding has been removed; "
                                                   "'zero_optimization.mics_shard_size' is no longer supported"):
        DeepSpeedConfig(_config(mics_shard_size=2))
