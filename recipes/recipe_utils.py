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
            with open_dict(cfg):
                cfg.ds_config = _ds_config_from_file(file_arg, ds_overrides)
        OmegaConf.resolve(cfg)
    except (HydraException, OmegaConfBaseException) as e:
        raise RecipeError(_one_line(e)) from None
    _drop_unset_optimizer_params(cfg)
    return cfg


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


def write_loss_curve(run_dir: Path, curves: dict[str, list[tuple[int, float]]]) -> Path:
    """A PNG with matplotlib when it is installed; otherwise (and always) loss_curve.json. Returns what was made."""
    data_path = run_dir / "loss_curve.json"
    data_path.write_text(json.dumps({k: [[s, v] for s, v in pts] for k, pts in curves.items()}) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return data_path
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
