"""accelerate's launch config, the YAML `accelerate config` writes for DeepSpeed, read by `fsdpzero launch
--config_file FILE` (pure: no torch, no process group).

`accelerate launch` turns that YAML into launcher flags and into ACCELERATE_* variables in each rank's environment,
which accelerate's `DeepSpeedPlugin()` / `Accelerator()` read inside the script (accelerate/utils/launch.py,
prepare_deepspeed_cmd_env). This does the same: the ranks see the variables `accelerate launch` would set (so an
unchanged accelerate script builds the same DeepSpeed config, and the shim runs it on fsdpzero), and the process
layout becomes `fsdpzero launch`'s flags. Every key gets a fate, as ds_config keys do: `mapped` (carried here or by
accelerate from the variable set here), `noop` (means nothing for this launch, and why), or an error naming the
key and the fix (a config for FSDP, Megatron-LM or SageMaker; a key accelerate does not know).
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any

# top-level keys -> (fate, how)
TOP = {
    "compute_environment": ("mapped", "LOCAL_MACHINE: this machine (AMAZON_SAGEMAKER is refused)"),
    "distributed_type": ("mapped", "DEEPSPEED: the shim runs accelerate's DeepSpeed integration on fsdpzero"),
    "num_processes": ("mapped", "processes in all; per machine = num_processes / num_machines (--num_gpus)"),
    "num_machines": ("mapped", "nodes; each runs this command (--num_nodes)"),
    "machine_rank": ("mapped", "this node's index (--node_rank)"),
    "main_process_ip": ("mapped", "node 0's address, torchrun's rendezvous endpoint (--master_addr)"),
    "main_process_port": ("mapped", "rendezvous port (--master_port)"),
    "gpu_ids": ("mapped", "the GPUs of this machine to run on (--include localhost:IDS)"),
    "mixed_precision": ("mapped", "ACCELERATE_MIXED_PRECISION: accelerate sets the config's bf16/fp16 section"),
    "deepspeed_config": ("mapped", "see its keys"),
    "debug": ("mapped", "ACCELERATE_DEBUG_MODE: accelerate's collective shape checks"),
    "enable_cpu_affinity": ("mapped", "ACCELERATE_CPU_AFFINITY: accelerate pins each rank to its NUMA node"),
    "use_cpu": ("noop", "the ranks follow the machine: gloo CPU ranks where there is no GPU, one per GPU otherwise"),
    "rdzv_backend": ("noop", "fsdpzero launch meets at torchrun's c10d rendezvous (static and c10d both work)"),
    "same_network": ("noop", "the rendezvous needs only main_process_ip reachable"),
    "main_training_function": ("noop", "notebook_launcher only"),
    "downcast_bf16": ("noop", "TPU only"),
    "dynamo_config": ("noop", "accelerate launch does not pass it to DeepSpeed runs either; use the ds_config's "
                              "`compile` section"),
    "tpu_name": ("noop", "TPU only"), "tpu_zone": ("noop", "TPU only"), "tpu_use_cluster": ("noop", "TPU only"),
    "tpu_use_sudo": ("noop", "TPU only"), "tpu_vm": ("noop", "TPU only"), "tpu_env": ("noop", "TPU only"),
    "command_file": ("noop", "TPU pods only"), "commands": ("noop", "TPU pods only"),
    "mpirun_config": ("noop", "fsdpzero launch starts ranks with torchrun, not mpirun"),
    "fp8_config": ("noop", "fp8 is not run by fsdpzero; mixed_precision fp8 is refused"),
}
# deepspeed_config keys -> (fate, how, the ACCELERATE_* variable accelerate's DeepSpeedPlugin reads, or None)
DEEPSPEED = {
    "deepspeed_config_file": ("mapped", "the ds_config (ACCELERATE_DEEPSPEED_CONFIG_FILE)",
                              "ACCELERATE_DEEPSPEED_CONFIG_FILE"),
    "zero_stage": ("mapped", "zero_optimization.stage", "ACCELERATE_DEEPSPEED_ZERO_STAGE"),
    "gradient_accumulation_steps": ("mapped", "gradient_accumulation_steps", "ACCELERATE_GRADIENT_ACCUMULATION_STEPS"),
    "gradient_clipping": ("mapped", "gradient_clipping", "ACCELERATE_GRADIENT_CLIPPING"),
    "offload_optimizer_device": ("mapped", "zero_optimization.offload_optimizer.device",
                                 "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"),
    "offload_param_device": ("mapped", "zero_optimization.offload_param.device",
                             "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE"),
    "offload_optimizer_nvme_path": ("mapped", "zero_optimization.offload_optimizer.nvme_path",
                                    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH"),
    "offload_param_nvme_path": ("mapped", "zero_optimization.offload_param.nvme_path",
                                "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH"),
    "zero3_init_flag": ("mapped", "models built after the Accelerator are sharded as they load (fsdpzero's "
                                  "HfDeepSpeedConfig)", "ACCELERATE_DEEPSPEED_ZERO3_INIT"),
    "zero3_save_16bit_model": ("mapped", "zero_optimization.stage3_gather_16bit_weights_on_model_save",
                               "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"),
    "deepspeed_multinode_launcher": ("noop", "torchrun on every node, as accelerate's `standard` launcher", None),
    "deepspeed_hostfile": ("mapped", "--hostfile", None),
    "deepspeed_inclusion_filter": ("mapped", "--include", None),
    "deepspeed_exclusion_filter": ("mapped", "--exclude", None),
}
# refused: key -> the fix
REFUSED_DEEPSPEED = {
    "deepspeed_moe_layer_cls_names": "ZeRO-3 leaf modules are not supported by fsdpzero (its units are the "
                                     "transformer blocks); remove the key",
}
REFUSED_TOP = {
    "fsdp_config": "this is accelerate's FSDP config; fsdpzero launch runs DeepSpeed configs: write a DeepSpeed one "
                   "(`accelerate config`, DeepSpeed) or run it with `accelerate launch`",
    "megatron_lm_config": "Megatron-LM is not run by fsdpzero; remove the section",
    "parallelism_config": "fsdpzero launch does not pass a launch config's parallel sizes to the ranks; remove the "
                          "section and set them in the script (your own loop: Accelerator(parallelism_config="
                          "ParallelismConfig(sp_backend=\"deepspeed\", sp_size=N))) or in the DeepSpeed config "
                          "(the HF Trainer: sequence_parallel_size; AutoTP: tensor_parallel.autotp_size)",
}
# variables `accelerate launch` sets from booleans: accelerate reads them as "true"/"false"
BOOL_VARS = {"ACCELERATE_DEEPSPEED_ZERO3_INIT", "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL"}


@dataclass
class AccelerateLaunch:
    env: dict[str, str] = field(default_factory=dict)           # for every rank, as accelerate launch sets it
    flags: dict[str, Any] = field(default_factory=dict)         # fsdpzero launch flags (argparse dest -> value)
    machines: int = 1
    rows: list[tuple[str, Any, str, str]] = field(default_factory=list)   # key, value, fate, how


def _fail(path: str, key: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"--config_file {path}: {key} = {value!r}: {fix}")


def _unknown(path: str, key: str, known) -> ValueError:
    close = difflib.get_close_matches(key.split(".")[-1], list(known), n=1)
    hint = f"did you mean {close[0]!r}?" if close else "remove it"
    return ValueError(f"--config_file {path}: unknown key {key!r} for accelerate's launch config: {hint}")


def read_accelerate_config(path: str) -> AccelerateLaunch:
    """The launch a DeepSpeed accelerate YAML (or JSON) asks for; ValueError naming the key and the fix."""
    try:
        import yaml
    except ImportError:
        raise ValueError(f"--config_file {path}: reading accelerate's YAML needs PyYAML (installed with accelerate: "
                         "pip install 'fsdpzero[hf]')") from None
    try:
        with open(path) as f:
            data = yaml.safe_load(f) if not path.endswith(".json") else __import__("json").load(f)
    except FileNotFoundError:
        raise ValueError(f"--config_file {path}: no such file") from None
    except Exception as e:   # a YAML syntax error: its own message names the line
        raise ValueError(f"--config_file {path}: not a YAML file ({' '.join(str(e).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config_file {path}: expected accelerate's config (a mapping of keys), got "
                         f"{type(data).__name__}")
    return translate(data, path)


def translate(data: dict, path: str = "<config>") -> AccelerateLaunch:
    out = AccelerateLaunch()
    for key in data:
        if key in REFUSED_TOP and data[key]:
            raise _fail(path, key, "{...}", REFUSED_TOP[key])
        if key not in TOP and key not in REFUSED_TOP:
            raise _unknown(path, key, list(TOP) + list(REFUSED_TOP))
    kind = str(data.get("distributed_type", "")).split(".")[-1].upper()
    if kind != "DEEPSPEED":
        fix = ("this is accelerate's FSDP config; fsdpzero launch runs DeepSpeed configs: write a DeepSpeed one "
               "(`accelerate config`, DeepSpeed) or run it with `accelerate launch`") if kind == "FSDP" else \
            "fsdpzero launch runs accelerate's DeepSpeed configs: set distributed_type: DEEPSPEED and a deepspeed_config"
        raise _fail(path, "distributed_type", data.get("distributed_type"), fix)
    env = out.env
    env["ACCELERATE_USE_DEEPSPEED"] = "true"
    where = str(data.get("compute_environment", "LOCAL_MACHINE")).split(".")[-1]
    if where != "LOCAL_MACHINE":
        raise _fail(path, "compute_environment", where, "SageMaker jobs are launched by accelerate; fsdpzero launch "
                                                        "runs LOCAL_MACHINE configs")
    ds = data.get("deepspeed_config") or {}
    if not isinstance(ds, dict):
        raise _fail(path, "deepspeed_config", ds, "expected a mapping (deepspeed_config_file: ds.json, or zero_stage: "
                                                  "... and the other keys `accelerate config` writes)")
    if not ds:
        raise _fail(path, "deepspeed_config", ds, "a DeepSpeed launch needs the section: deepspeed_config_file: "
                                                  "ds.json, or zero_stage: 2 (and the other keys)")
    for key, value in ds.items():
        name = f"deepspeed_config.{key}"
        if key in REFUSED_DEEPSPEED:
            if value not in (None, "", "none"):
                raise _fail(path, name, value, REFUSED_DEEPSPEED[key])
            continue
        if key not in DEEPSPEED:
            raise _unknown(path, name, DEEPSPEED)
        fate, how, var = DEEPSPEED[key]
        out.rows.append((name, value, fate, how))
        if value is None:
            continue
        if var is not None:
            env[var] = (str(bool(value)).lower() if var in BOOL_VARS else str(value).lower()
                        if key in ("gradient_clipping", "offload_optimizer_device", "offload_param_device")
                        else str(value))
    if "deepspeed_config_file" in ds and ds["deepspeed_config_file"] in (None, "", "none"):
        raise _fail(path, "deepspeed_config.deepspeed_config_file", ds["deepspeed_config_file"],
                    "give the ds_config's path, or remove the key and set zero_stage etc. inline")
    # the fields the YAML set (mixed_precision too): accelerate's DeepSpeedPlugin refuses them beside a config file
    env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(list(ds) + (["mixed_precision"] if "mixed_precision" in data
                                                               else [])).lower()
    for key in ("deepspeed_hostfile", "deepspeed_inclusion_filter", "deepspeed_exclusion_filter"):
        if ds.get(key) not in (None, ""):
            out.flags[{"deepspeed_hostfile": "hostfile", "deepspeed_inclusion_filter": "include",
                       "deepspeed_exclusion_filter": "exclude"}[key]] = str(ds[key])

    precision = str(data.get("mixed_precision", "no")).split(".")[-1].lower()
    if precision not in ("no", "fp16", "bf16"):
        raise _fail(path, "mixed_precision", precision, "use no, bf16 or fp16")
    env["ACCELERATE_MIXED_PRECISION"] = precision
    if data.get("debug"):
        env["ACCELERATE_DEBUG_MODE"] = "true"
    if data.get("enable_cpu_affinity"):
        env["ACCELERATE_CPU_AFFINITY"] = "1"

    machines = int(data.get("num_machines") or 1)
    processes = int(data.get("num_processes") if data.get("num_processes") not in (None, -1) else -1)
    if machines < 1:
        raise _fail(path, "num_machines", machines, "at least 1")
    if processes != -1:
        if processes < 1 or processes % machines:
            raise _fail(path, "num_processes", processes, f"the processes of all {machines} machine(s): a positive "
                                                          f"multiple of num_machines")
        out.flags["num_gpus"] = processes // machines
    out.machines = machines
    if machines > 1:
        out.flags["num_nodes"] = machines
        out.flags["node_rank"] = int(data.get("machine_rank") or 0)
        if not data.get("main_process_ip"):
            raise _fail(path, "main_process_ip", data.get("main_process_ip"),
                        f"{machines} machines meet at node 0's address: set main_process_ip")
    if data.get("main_process_ip"):
        out.flags["master_addr"] = str(data["main_process_ip"])
    if data.get("main_process_port") not in (None, ""):
        out.flags["master_port"] = int(data["main_process_port"])
    gpu_ids = data.get("gpu_ids")
    if gpu_ids not in (None, "", "all"):
        ids = [s.strip() for s in str(gpu_ids).split(",") if s.strip()]
        if machines > 1:
            raise _fail(path, "gpu_ids", gpu_ids, "per-GPU selection across machines: use deepspeed_inclusion_filter "
                                                  "or CUDA_VISIBLE_DEVICES on each node")
        if processes != -1 and processes != len(ids):
            raise _fail(path, "gpu_ids", gpu_ids, f"num_processes is {processes}: list that many GPUs, or 'all'")
        out.flags.pop("num_gpus", None)                # --include picks the slots
        out.flags["include"] = "localhost:" + ",".join(ids)
    for key, value in data.items():
        if key in TOP and key != "deepspeed_config":
            out.rows.append((key, value, *TOP[key]))
    return out


def format_rows(rows: list[tuple[str, Any, str, str]], path: str = "") -> str:
    """The startup block: one line of counts, then a table (key, value, fate, how) of the keys that are not simply
    mapped, as fsdpzero's ds_config startup block lists only what does not run as written."""
    counts = {fate: sum(1 for r in rows if r[2] == fate) for fate in ("mapped", "noop")}
    head = f"accelerate config {path}: {len(rows)} keys: {counts['mapped']} mapped, {counts['noop']} noop"
    cells = [(k, str(v), f, h) for k, v, f, h in rows if f != "mapped"]
    if not cells:
        return head
    w = [max(len(c[i]) for c in cells + [("key", "value", "fate", "how")]) for i in range(3)]
    lines = [head, f"{'key':<{w[0]}}  {'value':<{w[1]}}  {'fate':<{w[2]}}  how"]
    lines += [f"{k:<{w[0]}}  {v:<{w[1]}}  {f:<{w[2]}}  {h}" for k, v, f, h in cells]
    return "\n".join(lines)
