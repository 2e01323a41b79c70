"""fsdpzero/tuning.py: the knobs are one typed object, read from the environment, initialize(tuning=...) and a
recipe's `tuning:` node. A typo in any channel is an error naming the nearest knob; a bad value names the knob, the
value and what is allowed; the startup line lists exactly the non-default knobs and where each came from; the ops
receive their values without reading the environment."""
import logging
import os

import pytest
import torch
from torch import nn

from fsdpzero import tuning
from fsdpzero.tuning import KNOBS, Tuning, TuningError


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch):
    for var in [v for v in os.environ if v.startswith(tuning.ENV_PREFIX)]:
        monkeypatch.delenv(var)


def _typo(name: str) -> str:
    """Two neighbouring letters swapped in the middle of the name."""
    i = len(name) // 2
    return name[:i - 1] + name[i] + name[i - 1] + name[i + 1:] if name[i] != name[i - 1] else name[:i] + name[i + 1:]


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_a_typo_in_the_environment_names_the_knob(knob, monkeypatch):
    var, typo = tuning.env_name(knob), tuning.env_name(_typo(knob))
    monkeypatch.setenv(typo, "1")
    with pytest.raises(TuningError, match=f"unknown knob {typo} \\(environment\\); did you mean {var}\\?"):
        tuning.resolve()


@pytest.mark.parametrize("knob", sorted(KNOBS))
def test_a_typo_in_the_tuning_argument_names_the_knob(knob):
    with pytest.raises(TuningError, match=f"unknown knob {_typo(knob)} \\(tuning\\); did you mean {knob}\\?"):
        tuning.resolve({_typo(knob): True})


def test_harness_variables_are_not_knobs_and_not_errors(monkeypatch):
    for var in tuning.HARNESS_ENV:
        monkeypatch.setenv(var, "1")
    assert tuning.resolve() == Tuning()


@pytest.mark.parametrize("knob,value,allowed", [
    ("offload_overlap", "maybe", "one of 1/0/true/false"),
    ("offload_drop_shards", "sometimes", "one of 1/0/true/false/auto"),
    ("offload_threads", "0", "an integer from 1 to 1024 or auto"),
    ("offload_threads", "four", "an integer from 1 to 1024 or auto"),
    ("ckpt_writer_threads", "auto", "an integer from 1 to 256"),
    # upper bounds: 65536 threads aborted the process, 1000000 segfaulted it
    ("offload_threads", "65536", "an integer from 1 to 1024 or auto"),
    ("offload_threads", "1000000", "an integer from 1 to 1024 or auto"),
    ("offload_speculate_threads", "1025", "an integer from 1 to 1024 or auto"),
    ("ckpt_writer_threads", "257", "an integer from 1 to 256"),
    ("ckpt_crash_at", "after_lunch", "one of before_data/mid_write/before_rename/before_latest"),
    ("aio_backend", "uring", "one of auto/io_uring/libaio/threads/python"),
    ("cpu_adam_impl", "avx9", "one of auto/avx512/avx2/scalar/reference"),
])
def test_bad_values_name_knob_value_and_the_allowed_values(knob, value, allowed, monkeypatch):
    var = tuning.env_name(knob)
    monkeypatch.setenv(var, value)
    with pytest.raises(TuningError) as env_err:
        tuning.resolve()
    assert f"{var} = {value!r} (environment)" in str(env_err.value) and allowed in str(env_err.value)
    monkeypatch.delenv(var)
    with pytest.raises(TuningError) as arg_err:
        tuning.resolve({knob: value})
    assert f"{knob} = {value!r} (tuning)" in str(arg_err.value) and allowed in str(arg_err.value)
    with pytest.raises(TuningError, match=knob):
        Tuning(**{knob: value})
    assert "\n" not in str(env_err.value) + str(arg_err.value)


def test_values_are_typed_and_channels_layer(monkeypatch):
    monkeypatch.setenv("FSDPZERO_OFFLOAD_OVERLAP", "0")
    monkeypatch.setenv("FSDPZERO_OFFLOAD_THREADS", "6")
    monkeypatch.setenv("FSDPZERO_OFFLOAD_DROP_SHARDS", "auto")
    t = tuning.resolve()
    assert (t.offload_overlap, t.offload_threads, t.offload_drop_shards) == (False, 6, None)
    # the explicit argument wins over the environment; a Tuning counts by its non-default fields
    assert tuning.resolve({"offload_threads": "2", "OFFLOAD_SPECULATE": "yes"}).offload_threads == 2
    assert tuning.resolve(Tuning(offload_speculate=True)).offload_threads == 6
    assert tuning.resolve({"FSDPZERO_OFFLOAD_OVERLAP": True}).offload_overlap is True
    with pytest.raises(TuningError, match="expected a mapping"):
        tuning.resolve(["offload_overlap"])


def test_the_defaults_are_the_fast_exact_settings():
    t = Tuning()
    assert t.offload_overlap and t.offload_early_d2h and t.ckpt_stream and not t.sync_overflow_check
    assert t.non_defaults() == {}


def test_startup_line_lists_the_non_defaults_once(monkeypatch, caplog):
    monkeypatch.setenv("FSDPZERO_OFFLOAD_OVERLAP", "0")
    monkeypatch.setattr(tuning, "_printed", set())
    with caplog.at_level(logging.INFO, logger="fsdpzero"):
        tuning.use({"offload_threads": 3, "ckpt_stream": True})   # at its default: not listed
        tuning.use({"offload_threads": 3})                          # the same line is not printed twice
    lines = [r.getMessage() for r in caplog.records if "tuning" in r.getMessage()]
    assert lines == ["tuning (non-default): offload_overlap=False (env FSDPZERO_OFFLOAD_OVERLAP), "
                     "offload_threads=3 (tuning)"]
    monkeypatch.delenv("FSDPZERO_OFFLOAD_OVERLAP")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="fsdpzero"):
        tuning.use(None)
    assert not [r for r in caplog.records if "tuning" in r.getMessage()]   # all defaults: quiet


def test_ops_receive_their_values_without_reading_the_environment(monkeypatch):
    """fsdpzero_ops keeps no settings: an engine's knobs reach it as arguments (Tuning.cpu_adam_args/aio_args)."""
    from fsdpzero.offload.swapdir import aio_config
    from fsdpzero_ops import aio, cpu_adam
    monkeypatch.setenv("FSDPZERO_CPU_ADAM_IMPL", "reference")
    assert cpu_adam.CPUAdamW([torch.zeros(3)]).impl != "reference"   # the variable alone changes nothing in the ops
    knobs = tuning.resolve({"aio_backend": "python", "no_build": False})
    assert knobs.cpu_adam_args() == {"impl": "reference", "build": True}
    assert cpu_adam.CPUAdamW([torch.zeros(3)], **knobs.cpu_adam_args()).impl == "reference"
    with aio.AioHandle(aio_config(), **knobs.aio_args()) as handle:
        assert handle.backend == "python"
    assert tuning.resolve({"no_build": True}).cpu_adam_args() == {"impl": "reference", "build": False}
    assert cpu_adam.CPUAdamW([torch.zeros(3)], **tuning.resolve({"no_build": True}).cpu_adam_args()).impl \
        == "reference"


def test_initialize_refuses_a_typo_before_any_process_group():
    import torch.distributed as dist

    import fsdpzero
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(TuningError, match="did you mean offload_overlap"):
        fsdpzero.initialize(model=nn.Linear(2, 2), config=config, tuning={"ofload_overlap": False})
    assert not dist.is_initialized()


def test_the_code_reads_no_fsdpzero_variable_outside_tuning():
    """Every FSDPZERO_* read of the library goes through fsdpzero/tuning.py (names in comments and messages are
    fine; an os.environ / getenv call with such a name is not)."""
    import re
    from pathlib import Path
    root = Path(tuning.__file__).resolve().parents[1]
    pattern = re.compile(r"(environ(\.get)?\s*[\[(]|getenv\()\s*[\"']FSDPZERO_")
    sources = [*(root / "fsdpzero").rglob("*.py"), *(root / "ops" / "fsdpzero_ops").rglob("*.py")]   # and the ops
    assert any(p.parent.name == "fsdpzero_ops" for p in sources)
    offenders = [str(p.relative_to(root)) for p in sources
                 if p.name != "tuning.py" and pattern.search(p.read_text())]
    assert offenders == []


def _recipe_with(rank, world, argv, tmp):
    from tests.project.test_recipes import SMOKE, _bad_input
    return _bad_input(rank, world, [*argv, *SMOKE, f"run_dir={tmp}"])


def test_a_typo_in_the_recipe_tuning_node_is_one_line(tmp_path):
    from tests.multirank import run_distributed
    res = run_distributed(_recipe_with, 1, ["+tuning.offload_overlpa=false"], str(tmp_path), timeout=120,
                          init_pg=False)[0]
    errors = [ln for ln in res["err"].splitlines() if ln.startswith("error:")]
    assert res["code"] == 2 and len(errors) == 1, res
    assert "unknown knob offload_overlpa" in errors[0] and "did you mean offload_overlap?" in errors[0]



def test_docs_table_is_current():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "tuning.md").read_text()
    assert tuning.table() in doc, ("docs/tuning.md is stale: paste the output of "
                                   "python -c \"import fsdpzero.tuning as t; print(t.table())\"")


def _nvme_config(nvme_path: str) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "weight_decay": 0.01}},
            "zero_optimization": {"stage": 2, "sub_group_size": 20000,
                                  "offload_optimizer": {"device": "nvme", "nvme_path": nvme_path}}}


def _two_engines_job(rank, world, tmp):
    """Two engines in one process (TRL's policy and reference model), each with its own knobs: every save writes
    one DCP data file per writer thread and rank, so the files a save leaves show whose ckpt_writer_threads it read.
    Then two NVMe-offload engines with different op knobs: which CPU Adam kernel each one's step runs."""
    from pathlib import Path

    from fsdpzero.api import wrap
    from fsdpzero_ops import cpu_adam
    from tests.engine_cases import batches, build_model, engine_losses, make_plan
    one = wrap(build_model("gpt2", 0), make_plan(2, world=world, micro=1), tuning={"ckpt_writer_threads": 1})
    three = wrap(build_model("gpt2", 1), make_plan(2, world=world, micro=1), tuning={"ckpt_writer_threads": 3})
    os.environ["FSDPZERO_CKPT_WRITER_THREADS"] = "2"   # the process default when `plain` is built
    plain = wrap(build_model("gpt2", 2), make_plan(2, world=world, micro=1))
    os.environ["FSDPZERO_CKPT_WRITER_THREADS"] = "5"   # after every wrap: no engine reads it any more
    for engine, tag in ((one, "one"), (three, "three"), (plain, "plain"), (one, "one_again")):
        engine.save_checkpoint(tmp, tag=tag)
    files = {tag: len(list((Path(tmp) / tag).glob("*.distcp"))) for tag in ("one", "three", "plain", "one_again")}

    # the ops' knobs: `reference` is built first with the pure-torch kernel and the python aio engine, `native` after
    # it with the defaults; each one's step runs its own kernel (the ops keep no process-wide default)
    os.environ.pop("FSDPZERO_CKPT_WRITER_THREADS")
    for name in ("nvme_ref", "nvme_native"):
        (Path(tmp) / name).mkdir()
    reference = wrap(build_model("gpt2", 3), _nvme_config(f"{tmp}/nvme_ref"),
                     tuning={"cpu_adam_impl": "reference", "aio_backend": "python"})
    native = wrap(build_model("gpt2", 4), _nvme_config(f"{tmp}/nvme_native"))
    calls, real = [], cpu_adam.reference_adam_step_
    cpu_adam.reference_adam_step_ = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    kernels = {}
    for engine, name in ((reference, "reference"), (native, "native"), (reference, "reference_again")):
        calls.clear()
        engine_losses(engine, batches(1, 1, 2 * world, seed=len(kernels)), rank, world)
        engine.wait_for_params()   # the CPU step may still run (offload_overlap)
        opt = engine.grad_path.optimizer
        kernels[name] = ("reference" if calls else "native", opt._reader.backend)
    cpu_adam.reference_adam_step_ = real
    return files, kernels, cpu_adam.available_impls()[0]


def test_two_engines_in_one_process_keep_their_own_knobs(tmp_path):
    """Failed with the process-wide design: `plain` saved 5 files (the environment re-read at each save), and the
    `reference` engine's NVMe steps ran the native kernel once `native` was built (the ops' module default)."""
    from tests.multirank import run_distributed
    files, kernels, best = run_distributed(_two_engines_job, 1, str(tmp_path), timeout=300)[0]
    assert files == {"one": 1, "three": 3, "plain": 2, "one_again": 1}, files
    assert best != "reference", "the CPU Adam op could not be built here: the kernels cannot be told apart"
    native_aio = kernels["native"][1]
    assert kernels == {"reference": ("reference", "python"), "native": ("native", native_aio),
                       "reference_again": ("reference", "python")}, kernels
