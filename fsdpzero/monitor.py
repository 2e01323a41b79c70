"""DeepSpeed's monitor sections -- `tensorboard`, `csv_monitor`, `wandb`, `comet` -- written the way DeepSpeed writes
them. The Engine owns one (`engine.monitor`) and writes DeepSpeed's engine events into it at every optimizer step;
recipes add their own events (`Train/Samples/eval_loss`) through the same object.

Same section keys (`MonitorPlan`, from the ds_config), same files (csv: one `<output_path>/<job_name>/<tag with / and
space -> _>.csv` per tag, header `step,<last tag part>`; tensorboard: a SummaryWriter in `<output_path>/<job_name>`),
same tag names (`Train/Samples/lr`, `Train/Samples/loss_scale`, the `wall_clock_breakdown` timings, and
`Train/Samples/train_loss` as DeepSpeed's pipeline engine names it) and the same x-axis (global samples, not steps),
so dashboards built for DeepSpeed keep working. Rank 0 only; on other ranks `write_events` does nothing.
tensorboard, wandb and comet_ml are optional packages: an enabled section whose package is missing logs one warning
and is skipped instead of failing a training run (DeepSpeed raises).
"""
from __future__ import annotations

import csv
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Iterable, Mapping

log = logging.getLogger(__name__)

Event = tuple[str, float, int]   # (tag, value, global_samples)

# Timers the Engine keeps -> DeepSpeed's wall_clock_breakdown tags (engine.py `_write_monitor`).
TIMER_TAGS = ("forward", "backward", "backward_inner", "backward_allreduce", "step")


def _log_dir(section: Mapping[str, Any]) -> Path:
    # DeepSpeed: os.path.join(output_path, job_name); output_path "" means the working directory
    return Path(section.get("output_path") or ".") / section.get("job_name", "DeepSpeedJobName")


class _CsvWriter:
    def __init__(self, section: Mapping[str, Any]):
        self.dir = _log_dir(section)
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
    def __init__(self, section: Mapping[str, Any]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
        log_dir = _log_dir(section)
        log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, events: Iterable[Event]) -> None:
        for tag, value, step in events:
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _WandbWriter:
    def __init__(self, section: Mapping[str, Any]):
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=section.get("project", "deepspeed"), group=section.get("group"),
                              entity=section.get("team"))

    def write(self, events: Iterable[Event]) -> None:
        for tag, value, step in events:
            self.wandb.log({tag: value}, step=step)

    def close(self) -> None:
        self.run.finish()


class SampleInterval:
    """DeepSpeed's comet EventsLogScheduler: a tag is due at its first event, then once `every` samples have passed
    since it was last logged."""

    def __init__(self, every: int):
        self.every = every
        self.last: dict[str, int] = {}

    def due(self, tag: str, samples: int) -> bool:
        if tag in self.last and samples - self.last[tag] < self.every:
            return False
        self.last[tag] = samples
        return True


class _CometWriter:
    """comet_ml.start(...) with the section's keys; each tag thinned by `samples_log_interval`, as DeepSpeed."""

    def __init__(self, section: Mapping[str, Any]):
        import comet_ml
        self.interval = SampleInterval(int(section.get("samples_log_interval", 100)))
        self.experiment = comet_ml.start(api_key=section.get("api_key"), project=section.get("project"),
                                         workspace=section.get("workspace"),
                                         experiment_key=section.get("experiment_key"), mode=section.get("mode"),
                                         online=section.get("online"))
        if section.get("experiment_name") is not None:
            self.experiment.set_name(section["experiment_name"])

    def write(self, events: Iterable[Event]) -> None:
        for tag, value, step in events:
            if self.interval.due(tag, step):
                self.experiment.log_metric(tag, value, step=step)

    def close(self) -> None:
        self.experiment.end()


_WRITERS = {"tensorboard": _TensorBoardWriter, "wandb": _WandbWriter, "csv_monitor": _CsvWriter,
            "comet": _CometWriter}   # DeepSpeed's MonitorMaster order


def sections_of(source: Any) -> dict[str, Mapping[str, Any]]:
    """The enabled monitor sections of a `MonitorPlan` (None = off) or of a ds_config dict."""
    if dataclasses.is_dataclass(source):
        return {k: getattr(source, k) for k in _WRITERS if getattr(source, k) is not None}
    return {k: source[k] for k in _WRITERS if isinstance(source.get(k), Mapping) and source[k].get("enabled")}


class Monitor:
    """All enabled monitor sections behind DeepSpeed's `write_events(event_list)`; `source` is the plan's
    MonitorPlan or a ds_config dict."""

    def __init__(self, source: Any, rank: int | None = None):
        rank = int(os.environ.get("RANK", 0)) if rank is None else rank
        self.configured = bool(sections_of(source))     # the same on every rank (collectives may depend on it)
        self.writers: list = []
        if rank != 0:
            return
        for key, section in sections_of(source).items():
            try:
                self.writers.append(_WRITERS[key](section))
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
        self.writers = []
