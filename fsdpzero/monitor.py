"""DeepSpeed's monitor sections -- `tensorboard`, `csv_monitor`, `wandb` -- written the way DeepSpeed writes them.

Same section keys (enabled, output_path, job_name; wandb: project, group, team), same files (csv: one
`<output_path>/<job_name>/<tag with / -> _>.csv` per tag, header `step,<last tag part>`), same tag names
(`Train/Samples/lr`, `Train/Samples/train_loss`, `Train/Samples/loss_scale`, `Train/Samples/eval_loss`) and the
same x-axis (global samples, not steps), so dashboards built for DeepSpeed keep working. Rank 0 only; on other
ranks `write_events` does nothing. tensorboard and wandb are optional packages: an enabled section whose package is
missing logs one warning and is skipped instead of failing a training run.
"""
from __future__ import annotations

import csv
import logging
import os
from pathlib import Path
from typing import Any, Iterable

log = logging.getLogger(__name__)

Event = tuple[str, float, int]   # (tag, value, global_samples)


class _CsvWriter:
    def __init__(self, section: dict[str, Any]):
        self.dir = Path(section.get("output_path") or ".") / section.get("job_name", "DeepSpeedJobName")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.started: set[str] = set()

    def write(self, events: Iterable[Event]) -> None:
        for tag, value, step in events:
            name = tag.replace("/", "_").replace(" ", "_")
            with open(self.dir / f"{name}.csv", "a", newline="") as f:
                w = csv.writer(f)
                if name not in self.started:
                    self.started.add(name)
                    w.writerow(["step", tag.split("/")[-1]])
                w.writerow([step, value])

    def close(self) -> None:
        pass


class _TensorBoardWriter:
    def __init__(self, section: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        log_dir = Path(section.get("output_path") or ".") / section.get("job_name", "DeepSpeedJobName")
        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, events: Iterable[Event]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbWriter:
    def __init__(self, section: dict[str, Any]):
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=section.get("project", "deepspeed"), group=section.get("group"),
                              entity=section.get("team"))

    def write(self, events: Iterable[Event]) -> None:
        for tag, value, step in events:
            self.wandb.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


_WRITERS = {"csv_monitor": _CsvWriter, "tensorboard": _TensorBoardWriter, "wandb": _WandbWriter}


class Monitor:
    """All enabled monitor sections of a DeepSpeed config behind DeepSpeed's `write_events(event_list)`."""

    def __init__(self, ds_config: dict[str, Any], rank: int | None = None):
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.writers = []
        if rank != 0:
            return
        for key, cls in _WRITERS.items():
            section = ds_config.get(key) or {}
            if not section.get("enabled", False):
                continue
            try:
                self.writers.append(cls(section))
            except ImportError as e:
                log.warning("%s is enabled in the ds_config but %s is not installed: skipping it", key, e.name)

    @property
    def enabled(self) -> bool:
        return bool(self.writers)

    def write_events(self, events: list[Event]) -> None:
        for w in self.writers:
            w.write(events)

    def close(self) -> None:
        for w in self.writers:
            w.close()
