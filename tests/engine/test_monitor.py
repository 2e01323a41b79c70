"""The Engine writes DeepSpeed's monitor events itself: the same files, tags, x values (global samples) and values
as DeepSpeed's engine on the same run (CPU oracle, 2 gloo ranks), plus `Train/Samples/train_loss` equal to the
losses the run saw; the optional writers (comet, wandb) get DeepSpeed's calls."""
import csv
import sys
import types

import pytest
import torch

from tests.engine.test_oracle_deepspeed import MICRO, SCHEDULERS, VOCAB, WORLD, _config, _deepspeed, oracle_engine
from tests.multirank import run_distributed

STEPS, GA = 4, 2


def _rows(path):
    return list(csv.reader(open(path)))


def _train(rank, world, library, config, steps):
    engine = oracle_engine(library, config)
    g = torch.Generator().manual_seed(1234)
    data = [torch.randint(0, VOCAB, (MICRO, 16), generator=g) for _ in range(steps * GA * world)]
    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(GA):
            x = data[(step * GA + micro) * world + rank]
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            total += loss.detach().float()
        torch.distributed.all_reduce(total)
        losses.append(total.item() / (GA * world))
    return losses


@pytest.mark.oracle
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_monitor_files_match_deepspeeds(tmp_path):
    _deepspeed()
    out = {}
    for library in ("deepspeed", "fsdpzero"):
        cfg = _config(2, GA, SCHEDULERS["WarmupDecayLR"], wall_clock_breakdown=True,
                      csv_monitor={"enabled": True, "output_path": str(tmp_path / library), "job_name": "job"})
        out[library] = run_distributed(_train, WORLD, library, cfg, STEPS, timeout=300)[0]
    ds_dir, our_dir = tmp_path / "deepspeed" / "job", tmp_path / "fsdpzero" / "job"
    ds_files = sorted(p.name for p in ds_dir.iterdir())
    ours = sorted(p.name for p in our_dir.iterdir())
    assert "Train_Samples_lr.csv" in ds_files and "Train_Samples_elapsed_time_ms_step.csv" in ds_files
    assert ours == sorted(ds_files + ["Train_Samples_train_loss.csv"])   # DeepSpeed's pipeline engine adds it
    samples = [str(MICRO * GA * WORLD * (s + 1)) for s in range(STEPS)]
    for name in ds_files:
        theirs, mine = _rows(ds_dir / name), _rows(our_dir / name)
        assert mine[0] == theirs[0]                                          # header: step,<last tag part>
        assert [r[0] for r in mine[1:]] == [r[0] for r in theirs[1:]] == samples, name
        if name == "Train_Samples_lr.csv":
            assert [float(r[1]) for r in mine[1:]] == pytest.approx([float(r[1]) for r in theirs[1:]],
                                                                    rel=1e-7, abs=0)
        else:   # wall-clock timings: same tags and x values; the values are this machine's
            assert all(float(r[1]) >= 0 for r in mine[1:]), name
    loss = _rows(our_dir / "Train_Samples_train_loss.csv")
    assert loss[0] == ["step", "train_loss"] and [r[0] for r in loss[1:]] == samples
    assert [float(r[1]) for r in loss[1:]] == pytest.approx(out["fsdpzero"], rel=1e-6)
    assert [float(r[1]) for r in loss[1:]] == pytest.approx(out["deepspeed"], abs=1e-5)   # fp32 oracle tolerance


def _fp16_single(rank, world, out):
    import fsdpzero
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10 ** 9,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
           "fp16": {"enabled": True, "initial_scale_power": 4, "loss_scale_window": 2},
           "csv_monitor": {"enabled": True, "output_path": out, "job_name": "j"}}
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    engine, *_ = fsdpzero.initialize(model=model, config=cfg)
    scales, losses = [], []
    for _ in range(3):
        loss = engine(torch.randn(2, 8)).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        scales.append(engine.get_loss_scale())
        losses.append(loss.item())
    return scales, losses, engine.plan.monitor


def test_engine_monitor_fp16_loss_scale_and_rank_gate(tmp_path):
    """One rank, fp16 (DeepSpeed writes the loss scale only then): loss_scale equals get_loss_scale() after each
    step; train_loss the step's loss; no timings without wall_clock_breakdown; a rank other than 0 writes nothing."""
    from fsdpzero.monitor import Monitor
    scales, losses, monitor_plan = run_distributed(_fp16_single, 1, str(tmp_path), timeout=120)[0]
    rows = _rows(tmp_path / "j" / "Train_Samples_loss_scale.csv")
    assert rows[0] == ["step", "loss_scale"]
    assert [(int(a), float(b)) for a, b in rows[1:]] == [(2 * (i + 1), s) for i, s in enumerate(scales)]
    assert scales[-1] > scales[0]                              # the window of 2 doubled it: the value is live
    got = [float(r[1]) for r in _rows(tmp_path / "j" / "Train_Samples_train_loss.csv")[1:]]
    assert got == pytest.approx(losses, rel=1e-6)
    assert sorted(p.name for p in (tmp_path / "j").iterdir()) == [
        "Train_Samples_loss_scale.csv", "Train_Samples_lr.csv", "Train_Samples_train_loss.csv"]
    quiet = Monitor(monitor_plan, rank=1)
    assert quiet.configured and not quiet.enabled


def test_comet_wandb_tensorboard_writers_make_deepspeeds_calls(monkeypatch, tmp_path):
    """comet_ml / wandb / tensorboard are optional (none is installed here; stand-ins record the calls): the
    section's keys reach comet_ml.start / wandb.init / SummaryWriter as DeepSpeed passes them, every event reaches
    wandb and tensorboard, and comet logs a tag again only after samples_log_interval samples."""
    from fsdpzero.monitor import Monitor
    calls = []

    class Experiment:
        def set_name(self, name):
            calls.append(("set_name", name))

        def log_metric(self, name, value, step):
            calls.append(("log", name, value, step))

        def end(self):
            calls.append(("end",))

    comet = types.SimpleNamespace(start=lambda **kw: calls.append(("start", kw)) or Experiment())
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(
        finish=lambda: calls.append(("finish",))), log=lambda d, step: calls.append(("wandb", d, step)))
    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("tb", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append(("scalar", tag, value, step))

        def flush(self):
            pass

        def close(self):
            calls.append(("tb_close",))

    monkeypatch.setitem(sys.modules, "comet_ml", comet)
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    m = Monitor({"comet": {"enabled": True, "samples_log_interval": 10, "project": "p", "experiment_name": "e"},
                 "wandb": {"enabled": True, "project": "q", "team": "t"},
                 "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}, rank=0)
    for x in (4, 8, 14, 20, 24):
        m.write_events([("Train/Samples/lr", 0.1, x)])
    m.close()
    assert ("start", dict(api_key=None, project="p", workspace=None, experiment_key=None, mode=None,
                          online=None)) in calls
    assert ("set_name", "e") in calls
    assert ("init", dict(project="q", group=None, entity="t")) in calls
    assert [c[3] for c in calls if c[0] == "log"] == [4, 14, 24]
    assert [c[2] for c in calls if c[0] == "wandb"] == [4, 8, 14, 20, 24]
    assert ("tb", str(tmp_path / "tb")) in calls and ("tb_close",) in calls    # DeepSpeed: output_path/job_name
    assert [c[1:] for c in calls if c[0] == "scalar"] == [("Train/Samples/lr", 0.1, x) for x in (4, 8, 14, 20, 24)]


def _recording_writers(calls: list) -> dict:
    """Stand-ins for comet_ml / wandb / tensorboard (none is installed here) that record every call made on them."""
    class Experiment:
        def set_name(self, name):
            calls.append(("set_name", name))

        def log_metric(self, name, value, step):
            calls.append(("log", name, value, step))

        __internal_api__log_metric__ = log_metric   # what DeepSpeed 0.19.8 calls

        def end(self):
            pass

    class SummaryWriter:
        def __init__(self, log_dir):
            calls.append(("tb", log_dir))

        def add_scalar(self, tag, value, step):
            calls.append(("scalar", tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    comet = types.SimpleNamespace(__version__="3.50.0", start=lambda **kw: calls.append(("start", kw)) or Experiment())
    wandb = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or types.SimpleNamespace(
        finish=lambda: None), log=lambda d, step, commit=None: calls.append(("wandb", d, step)))
    return {"comet_ml": comet, "wandb": wandb, "tensorboard": types.ModuleType("tensorboard"),
            "torch.utils.tensorboard": types.SimpleNamespace(SummaryWriter=SummaryWriter)}


@pytest.mark.oracle
def test_writers_make_the_calls_deepspeeds_own_writers_make(monkeypatch, tmp_path):
    """DeepSpeed's CometMonitor, WandbMonitor and TensorBoardMonitor (0.19.8) and ours, over the same recording
    stand-ins, the same section and the same events: the same calls, in the same order."""
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.monitor import comet as ds_comet, tensorboard as ds_tb, wandb as ds_wandb
    from deepspeed.monitor.config import CometConfig, TensorBoardConfig, WandbConfig
    from fsdpzero.monitor import Monitor
    section = {"comet": {"enabled": True, "samples_log_interval": 10, "project": "p", "experiment_name": "e"},
               "wandb": {"enabled": True, "project": "q", "team": "t", "group": "g"},
               "tensorboard": {"enabled": True, "output_path": str(tmp_path), "job_name": "tb"}}
    events = [("Train/Samples/lr", 0.1 * x, x) for x in (4, 8, 14, 20, 24)] + [("Train/Samples/train_loss", 2.5, 24)]
    theirs, ours = [], []
    for module in (ds_comet, ds_tb, ds_wandb):
        monkeypatch.setattr(module.dist, "get_rank", lambda: 0)
    for name, stand_in in _recording_writers(theirs).items():
        monkeypatch.setitem(sys.modules, name, stand_in)
    writers = [ds_comet.CometMonitor(CometConfig(**section["comet"])),
               ds_wandb.WandbMonitor(WandbConfig(**section["wandb"])),
               ds_tb.TensorBoardMonitor(TensorBoardConfig(**section["tensorboard"]))]
    for w in writers:            # DeepSpeed's MonitorMaster hands each writer the whole list
        w.write_events(events)
    for name, stand_in in _recording_writers(ours).items():
        monkeypatch.setitem(sys.modules, name, stand_in)
    Monitor(section, rank=0).write_events(events)

    def by_writer(calls):
        kinds = {"start": "comet", "set_name": "comet", "log": "comet", "init": "wandb", "wandb": "wandb",
                 "tb": "tb", "scalar": "tb"}
        return {k: [c for c in calls if kinds[c[0]] == k] for k in ("comet", "wandb", "tb")}

    assert by_writer(ours) == by_writer(theirs)
    assert len([c for c in theirs if c[0] == "log"]) == 4   # comet's interval skipped some: the check has teeth


@pytest.mark.oracle
def test_comet_interval_is_deepspeeds(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    pytest.importorskip("deepspeed")
    from deepspeed.monitor.comet import EventsLogScheduler
    from fsdpzero.monitor import SampleInterval
    theirs, ours = EventsLogScheduler(7), SampleInterval(7)
    seq = [(t, x) for x in (0, 3, 7, 8, 15, 16, 30, 31) for t in ("a", "b")]
    assert [ours.due(t, x) for t, x in seq] == [theirs.needs_logging(t, x) for t, x in seq]


def test_missing_package_is_one_warning_not_an_error(monkeypatch, tmp_path):
    import fsdpzero.monitor as monitor
    warned = []
    monkeypatch.setattr(monitor.log, "warning", lambda msg, *args: warned.append(msg % args))
    monkeypatch.setitem(sys.modules, "comet_ml", None)        # import comet_ml raises ImportError
    m = monitor.Monitor({"comet": {"enabled": True},
                         "csv_monitor": {"enabled": True, "output_path": str(tmp_path)}}, rank=0)
    assert [type(w).__name__ for w in m.writers] == ["_CsvWriter"] and m.configured
    assert warned == ["comet is enabled in the ds_config but comet_ml is not installed: skipping it"]
