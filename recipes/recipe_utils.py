"""What both recipes share: composing the Hydra config, the run directory, one-line errors, the loss curve.

Hydra is used through its compose API rather than `@hydra.main`. Under torchrun every rank would otherwise run
Hydra's job setup: a timestamped output directory per rank (clocks differ by a second), log files written by every
rank into the same place, and multi-line Hydra tracebacks for a typo. Here each rank composes the same config
silently; rank 0 alone creates the pinned run directory, saves the composed config and the DeepSpeed config there,
and logs. Nothing changes directory (Hydra's `hydra.job.chdir=False` behaviour).
"""
from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


class RecipeError(Exception):
    """Bad input: printed as one line (rank 0), exit status 2."""


def rank_and_world() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment; a plain `python` run is rank 0 of 1."""
    return int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def compose(config_name: str, argv: list[str]) -> DictConfig:
    """The config for `argv` (Hydra override syntax). `ds_config=FILE` swaps the composed `ds_config` node for the
    JSON file; the `ds_config.KEY=VALUE` overrides then apply to that file's keys."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    argv = [a for a in argv if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    for a in argv:
        if a.startswith("-"):
            raise RecipeError(f"unknown option {a!r}: this recipe takes Hydra overrides only, like zero=stage2 "
                              f"optim.lr=3e-4 (see {CONF_DIR})")
    file_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("ds_config=")), None)
    ds_overrides = [a for a in argv if file_arg is not None and a.lstrip("+~").startswith("ds_config.")]
    hydra_overrides = [a for a in argv if not a.startswith("ds_config=") and a not in ds_overrides]
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3", job_name=config_name):
            cfg = hydra_compose(config_name=config_name, overrides=hydra_overrides)
        if file_arg is not None:
            composed = OmegaConf.to_container(cfg.ds_config, resolve=True)
            with open_dict(cfg):
                cfg.ds_config = _ds_config_from_file(file_arg, ds_overrides)
            fill_from_recipe(cfg, composed)
        if "resume" in cfg:
            cfg.run_dir = choose_run_dir(cfg)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        raise RecipeError(_one_line(e)) from None
    _drop_unset_optimizer_params(cfg)
    return cfg


# -- a DeepSpeed file full of "auto": filled from the recipe's values, as the Hugging Face Trainer fills them -----

def hidden_size(cfg: DictConfig) -> int | None:
    """model.config.hidden_size, which the Trainer's bucket-size "auto"s use: from the model group, or from the
    pretrained folder's config.json (sft_hf.py)."""
    node = OmegaConf.to_container(cfg.model, resolve=True)
    pretrained = node.get("pretrained")
    if pretrained and (Path(pretrained) / "config.json").is_file():
        node = json.loads((Path(pretrained) / "config.json").read_text())
    for key in ("hidden_size", "n_embd", "d_model"):
        if isinstance(node.get(key), int):
            return node[key]
    return None


def trainer_values(cfg: DictConfig, composed: dict) -> dict:
    """The recipe's values under the TrainingArguments names fsdpzero.config.auto resolves "auto" from."""
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    betas = optim.get("betas") or [None, None]
    warmup = OmegaConf.select(cfg, "sched.params.warmup_num_steps", default=None)
    enabled = lambda section: bool((composed.get(section) or {}).get("enabled", False))   # noqa: E731
    return {"per_device_train_batch_size": OmegaConf.select(cfg, "data.micro_batch_size"),
            "gradient_accumulation_steps": cfg.trainer.grad_accum, "learning_rate": optim.get("lr"),
            "weight_decay": optim.get("weight_decay"), "adam_beta1": betas[0], "adam_beta2": betas[1],
            "adam_epsilon": optim.get("eps"), "max_grad_norm": optim.get("grad_clip"),
            "warmup_steps": warmup, "max_steps": cfg.trainer.max_steps, "num_training_steps": cfg.trainer.max_steps,
            "bf16": enabled("bf16"), "fp16": enabled("fp16"), "hidden_size": hidden_size(cfg),
            "world_size": rank_and_world()[2]}


def fill_from_recipe(cfg: DictConfig, composed: dict) -> None:
    """`ds_config=FILE` with "auto" values (a Hugging Face or LLaMA-Factory config): each "auto" the Trainer knows
    is filled by the Trainer's own rule (fsdpzero.config.auto.RULES) from the recipe's values; explicit values of the
    file are kept. A file without an optimizer or scheduler section gets the recipe's (optim/, sched/), as the
    Trainer then uses its own. Whatever stays "auto" is reported by the config layer."""
    from fsdpzero.config.auto import RULES
    ds = OmegaConf.to_container(cfg.ds_config, resolve=True)
    values = trainer_values(cfg, composed)
    stage = (ds.get("zero_optimization") or {}).get("stage", 0)

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}{key}"
            if isinstance(value, dict):
                walk(value, f"{path}.")
            elif value == "auto" and path in RULES and not (RULES[path][3] and stage != 3):
                try:
                    node[key] = RULES[path][1](values)
                except Exception:   # the rule's input is missing (e.g. no hidden size): the config layer says so
                    pass

    walk(ds, "")
    for section in ("optimizer", "scheduler"):
        if section not in ds and section in composed:
            ds[section] = composed[section]
    with open_dict(cfg):
        cfg.ds_config = OmegaConf.create(ds)


# -- one run directory, one configuration ---------------------------------------------------------------------------

# keys that may change between the legs of one run (logging, monitors, the step budget), so not part of its identity
VOLATILE = ("steps_per_print", "wall_clock_breakdown", "csv_monitor", "tensorboard", "wandb", "comet",
            "flops_profiler", "dump_state", "scheduler.params.total_num_steps")
RUN_RECORD = "run.json"


def run_identity(cfg: DictConfig) -> dict:
    """What a checkpoint in run_dir belongs to: model, data, seed and the DeepSpeed config, minus VOLATILE keys,
    with the run directory itself written as <run_dir> (nvme paths live under it)."""
    full = OmegaConf.to_container(cfg, resolve=True)
    run_dir = str(full["run_dir"])

    def neutral(node):
        if isinstance(node, dict):
            return {k: neutral(v) for k, v in node.items()}
        if isinstance(node, list):
            return [neutral(v) for v in node]
        return node.replace(run_dir, "<run_dir>") if isinstance(node, str) else node

    ds = full["ds_config"]
    for key in VOLATILE:
        parent, _, leaf = key.rpartition(".")
        node = ds
        for part in parent.split(".") if parent else []:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    return neutral({"model": full["model"], "data": full["data"], "seed": full["seed"], "ds_config": ds})


def identity_digest(identity: dict) -> str:
    import hashlib
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:8]


def describe_difference(old: dict, new: dict, limit: int = 4) -> str:
    """`key: old -> new` for the first few keys that differ (dotted paths)."""
    def flat(node, prefix=""):
        if isinstance(node, dict):
            for k, v in node.items():
                yield from flat(v, f"{prefix}{k}.")
        else:
            yield prefix[:-1], node
    a, b = dict(flat(old)), dict(flat(new))
    changed = sorted((k not in a or k not in b, k) for k in set(a) | set(b)
                     if a.get(k, "<unset>") != b.get(k, "<unset>"))
    diffs = [f"{k}: {json.dumps(a.get(k, '<unset>'))} -> {json.dumps(b.get(k, '<unset>'))}"
             for _, k in changed]          # values that changed first, then keys one side lacks
    more = f", and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return "; ".join(diffs[:limit]) + more


def choose_run_dir(cfg: DictConfig) -> str:
    """resume=auto never continues a run of another configuration. The default run_dir (outputs/<name>) holding one
    sends this run to outputs/<name>-<digest of its configuration> (its own place, resumable in turn); a run_dir
    given explicitly is refused with what differs. Every rank decides alike: rank 0 writes run.json (atomically)
    only into the directory the decision picks, before anything else there."""
    run_dir = Path(cfg.run_dir)
    if str(cfg.resume) != "auto":
        return str(run_dir)
    identity = run_identity(cfg)
    for attempt in (run_dir, run_dir.with_name(f"{run_dir.name}-{identity_digest(identity)}")):
        record = attempt / RUN_RECORD
        stored = json.loads(record.read_text())["identity"] if record.is_file() else None
        if stored == identity or (stored is None and latest_checkpoint(attempt / "checkpoints") is None):
            if attempt != run_dir and rank_and_world()[0] == 0:
                print(f"note: {run_dir} holds a run of another configuration ({why}); this run uses {attempt}",
                      file=sys.stderr, flush=True)
            return str(attempt)
        why = (describe_difference(stored, identity) if stored is not None else
               "a checkpoint with no record of its configuration")
        if str(run_dir) != f"outputs/{cfg.name}":
            break
    raise RecipeError(f"run_dir={run_dir} holds a run of another configuration ({why}), which resume=auto would "
                      f"continue: pass resume=never to start over there, or choose another run_dir")


def _ds_config_from_file(path: str, overrides: list[str]) -> DictConfig:
    p = Path(path).expanduser()
    if not p.is_file():
        raise RecipeError(f"ds_config={path}: no such file (give the path of a DeepSpeed JSON config, "
                          f"e.g. ds_config=tests/ds_configs/hf_transformers_zero3.json)")
    try:
        node = OmegaConf.create(json.loads(p.read_text()))
    except json.JSONDecodeError as e:
        raise RecipeError(f"ds_config={path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    for ov in overrides:
        if "=" not in ov and not ov.startswith("~"):
            raise RecipeError(f"override {ov!r}: expected ds_config.KEY=VALUE")
        key, _, value = ov.lstrip("+~").partition("=")
        key = key[len("ds_config."):]
        if ov.startswith("~"):
            parent, _, leaf = key.rpartition(".")
            container = OmegaConf.select(node, parent) if parent else node
            if container is None or leaf not in container:
                raise RecipeError(f"override {ov!r}: {path} has no key {key!r}")
            container.pop(leaf)
            continue
        if not ov.startswith("+") and OmegaConf.select(node, key, default="__missing__") == "__missing__":
            raise RecipeError(f"override {ov!r}: {path} has no key {key!r} (add one with +{ov.lstrip('+')})")
        OmegaConf.update(node, key, OmegaConf.from_dotlist([f"v={value}"]).v, force_add=True)
    return node


def _drop_unset_optimizer_params(cfg: DictConfig) -> None:
    """optim/ groups share one set of keys; a null one (SGD's betas) is left out of DeepSpeed's optimizer.params."""
    params = OmegaConf.select(cfg, "ds_config.optimizer.params")
    if isinstance(params, DictConfig):
        for k in [k for k, v in params.items() if v is None]:
            params.pop(k)


def _one_line(e: BaseException) -> str:
    """Hydra's and OmegaConf's messages span several lines (full_key, object_type, search path, hints): keep the
    gist, and say what to do for the commonest mistake, a key that does not exist."""
    text = str(e).strip()
    if text.startswith("Could not override"):
        key = text.split("'")[1] if "'" in text else "?"
        return (f"unknown override {key!r}: the config has no such key (check the spelling against conf/, or add a "
                f"new key with +{key}=VALUE)")
    skip = ("full_key:", "object_type", "reference_type", "Set the env", "Config search path", "provider=")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith(skip)]
    return "; ".join(lines) or type(e).__name__


def ds_config_dict(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg.ds_config, resolve=True)


def setup_run_dir(cfg: DictConfig, rank: int) -> Path:
    """Rank 0 creates the pinned run dir, saves config.yaml and ds_config.json, and logs to train.log there."""
    run_dir = Path(cfg.run_dir)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        if "resume" in cfg:                        # first: what this directory's checkpoints belong to
            tmp = run_dir / f".{RUN_RECORD}.tmp"
            tmp.write_text(json.dumps({"identity": run_identity(cfg)}, indent=1) + "\n")
            os.replace(tmp, run_dir / RUN_RECORD)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
        (run_dir / "ds_config.json").write_text(json.dumps(ds_config_dict(cfg), indent=2) + "\n")
        handler = logging.FileHandler(run_dir / "train.log")
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        from fsdpzero.log import setup_logging
        setup_logging()                                      # its console handler first, then our file
        logging.getLogger("fsdpzero").addHandler(handler)   # the engine's logger does not propagate
    return run_dir


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    """DeepSpeed's layout: ckpt_dir/latest names the newest tag directory."""
    latest = ckpt_dir / "latest"
    if latest.is_file():
        tag = latest.read_text().strip()
        if (ckpt_dir / tag).is_dir():
            return ckpt_dir
    return None


def earlier_curve(run_dir: Path, name: str) -> list[tuple[int, float]]:
    """The points of curve `name` that an earlier leg of this run wrote to loss_curve.json (none if no file)."""
    path = run_dir / "loss_curve.json"
    try:
        return [(int(s), float(v)) for s, v in json.loads(path.read_text()).get(name, [])]
    except (OSError, ValueError):
        return []


NO_PNG = " (matplotlib not installed: data only; `pip install matplotlib` or the recipes extra draws the PNG)"


def write_loss_curve(run_dir: Path, curves: dict[str, list[tuple[int, float]]]) -> Path:
    """loss_curve.png, drawn with matplotlib (the recipes extra installs it), and always loss_curve.json (the data).
    Returns the PNG, or the JSON where matplotlib is missing."""
    data_path = run_dir / "loss_curve.json"
    data_path.write_text(json.dumps({k: [[s, v] for s, v in pts] for k, pts in curves.items()}) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return data_path
    logging.getLogger("matplotlib").setLevel(logging.WARNING)   # its font-cache notice is not the user's business
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in curves.items():
        if pts:
            ax.plot([s for s, _ in pts], [v for _, v in pts], label=name, marker="o" if len(pts) < 20 else None)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    png = run_dir / "loss_curve.png"
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return png


def run_main(recipe_main, config_name: str) -> None:
    """Compose, run, and turn bad input into one line on stderr (rank 0) and exit status 2."""
    rank = rank_and_world()[0]
    try:
        cfg = compose(config_name, sys.argv[1:])
        recipe_main(cfg)
    except RecipeError as e:
        if rank == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:
        if type(e).__name__ == "ConfigError":  # fsdpzero's config layer: already one readable line per problem
            if rank == 0:
                print(f"error: invalid ds_config: {e}", file=sys.stderr)
            sys.exit(2)
        raise
