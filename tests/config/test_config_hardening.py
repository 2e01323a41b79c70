"""Issue 22 (findings 7 and 9) and issue 21's rounded sizes: configs that validated but failed or misbehaved at run
time, and files that made the reader trace back, hang or read without end. Each case is an error naming the key,
the value and the fix, raised by load_config: before any process group exists."""
import json
import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from fsdpzero.config import ConfigError, load_config
from fsdpzero.config.load import MAX_CONFIG_BYTES, MAX_DEPTH
from fsdpzero.plan import Env
from fsdpzero.plan.report import fate_table
from fsdpzero.plan.translate import build_plan, translate

BASE = {"train_micro_batch_size_per_gpu": 2}


def problem(source, key=None, **kw):
    """The one problem the config raises (its key checked), printed as the user sees it."""
    with pytest.raises(ConfigError) as e:
        load_config(source, **kw)
    assert len(e.value.problems) == 1, e.value.problems
    p = e.value.problems[0]
    if key is not None:
        assert p.key == key, p
    assert p.suggestion and "\n" not in str(p), p
    assert not dist.is_initialized()
    return p


# ---------------------------------------------------------------- "auto" where a section or the stage is needed
@pytest.mark.parametrize("section", ["zero_optimization", "bf16", "fp16", "optimizer", "scheduler", "aio",
                                     "activation_checkpointing", "checkpoint", "tensorboard"])
def test_a_whole_section_set_to_auto_is_an_error(section):
    # DeepSpeed 0.19.8 raises a TypeError (strict sections: `Config(**"auto")`) or AttributeError (lenient ones:
    # "auto".get) on most of these (test_deepspeed_raises_on_auto_sections); we used to drop it and run defaults
    p = problem({**BASE, section: "auto"}, section, context={"hidden_size": 64, "world_size": 1})
    assert '"auto" for a whole section' in p.message and "JSON object" in p.message


@pytest.mark.parametrize("path", [("zero_optimization", "offload_optimizer"), ("zero_optimization", "offload_param"),
                                  ("optimizer", "params"), ("checkpoint", "writer")])
def test_a_nested_section_set_to_auto_is_an_error(path):
    cfg = {**BASE, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}, "checkpoint": {}}
    cfg[path[0]][path[1]] = "auto"
    problem(cfg, ".".join(path))


def test_stage_auto_is_an_error_not_a_silent_stage_0():
    # DeepSpeed drops "auto" inside its pydantic sections and runs stage 0; nothing (HF Trainer included) fills it
    p = problem({**BASE, "zero_optimization": {"stage": "auto"}}, "zero_optimization.stage")
    assert "0, 1, 2 or 3" in p.suggestion


def test_autos_that_do_resolve_still_work():
    cfg = load_config({**BASE, "bf16": {"enabled": "auto"}, "zero_optimization": {
        "stage": 3, "stage3_gather_16bit_weights_on_model_save": "auto", "reduce_bucket_size": "auto"}},
        context={"bf16": True, "hidden_size": 8})
    assert cfg.bf16.enabled and cfg.zero_optimization.reduce_bucket_size == 64


@pytest.mark.oracle
def test_deepspeed_raises_on_auto_sections():
    """The DeepSpeed behaviour the messages state, checked on DeepSpeed itself."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    for section in ("zero_optimization", "bf16", "fp16"):
        with pytest.raises(TypeError, match="must be a mapping"):
            ds_config.DeepSpeedConfig({"train_batch_size": 1, section: "auto"})
    c = ds_config.DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {"stage": "auto"}})
    assert c.zero_optimization_stage == 0        # silently: why fsdpzero refuses it
    # what DeepSpeed takes and fails on later (the bounds), and the float size it refuses (we round it)
    c = ds_config.DeepSpeedConfig({"train_batch_size": 1, "fp16": {"enabled": True, "hysteresis": 0},
                                   "aio": {"intra_op_parallelism": 100000}})
    assert c.aio_config["intra_op_parallelism"] == 100000
    with pytest.raises(Exception, match="fractional part"):
        ds_config.DeepSpeedConfig({"train_batch_size": 1, "zero_optimization": {
            "stage": 3, "stage3_prefetch_bucket_size": 943718.4}})


# ---------------------------------------------------------------- bounds on what sizes memory, threads, loops
@pytest.mark.parametrize("cfg, key", [
    ({"fp16": {"enabled": True, "initial_scale_power": 10**40}}, "fp16.initial_scale_power"),   # hung: 2**(10**40)
    ({"fp16": {"enabled": True, "initial_scale_power": 128}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True, "initial_scale_power": -1}}, "fp16.initial_scale_power"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis"),       # the scale never drops: every step
    ({"aio": {"intra_op_parallelism": 100000}}, "aio.intra_op_parallelism"),  # aborted both ranks
    ({"aio": {"intra_op_parallelism": 1e5}}, "aio.intra_op_parallelism"),
    ({"aio": {"queue_depth": 10**6}}, "aio.queue_depth"),
    ({"aio": {"block_size": 5000}}, "aio.block_size"),                        # not O_DIRECT aligned
    ({"aio": {"block_size": 2**40}}, "aio.block_size"),
    ({"steps_per_print": 0}, "steps_per_print"),
    ({"gradient_clipping": math.inf}, "gradient_clipping"),
    ({"gradient_accumulation_steps": 2**40}, "gradient_accumulation_steps"),
    ({"zero_optimization": {"stage": 3, "sub_group_size": 0, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/x"}}}, "zero_optimization.sub_group_size"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": -5}}, "zero_optimization.reduce_bucket_size"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/x",
                                                              "buffer_count": 10**6}}},
     "zero_optimization.offload_optimizer.buffer_count"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": math.inf}}}, "optimizer.params.lr"),   # NaN weights
    ({"optimizer": {"type": "AdamW", "params": {"lr": math.nan}}}, "optimizer.params.lr"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": 0}}}, "optimizer.params.eps"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 1.0]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [0.9, math.nan]}}}, "optimizer.params.betas"),
    ({"optimizer": {"type": "AdamW", "params": {"weight_decay": math.inf}}}, "optimizer.params.weight_decay"),
    ({"optimizer": {"type": "SGD", "params": {"momentum": math.inf}}}, "optimizer.params.momentum"),
    ({"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 0, "cycle_max_lr": 1e-3,
                                                   "cycle_first_step_size": 0}}},
     "scheduler.params.cycle_first_step_size"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": math.inf}}}, "scheduler.params.warmup_max_lr"),
    ({"x": 10**30}, "x"),                                                     # beyond int64 anywhere
], ids=lambda v: v if isinstance(v, str) else None)
def test_out_of_range_values_are_one_error_naming_the_key(cfg, key):
    p = problem({**BASE, **cfg}, key)
    assert len(str(p)) < 400                  # one readable line, even for a 40-digit value


def test_sub_group_size_0_stays_legal_without_nvme():
    # DeepSpeed: a sub-group per parameter; a real config (axolotl zero3 bf16 cpuoffload) writes 0
    raw = {**BASE, "zero_optimization": {"stage": 3, "sub_group_size": 0}}
    cfg = load_config(raw)
    assert cfg.zero_optimization.sub_group_size == 0 and not cfg.warnings
    plan = build_plan(raw, Env())
    assert plan.offload.sub_group_size == 0
    decision = next(d for d in plan.decisions if d.key == "zero_optimization.sub_group_size")
    assert (decision.value, decision.status) == (0, "noop")     # it only tiles an offloaded optimizer step


def test_the_sane_edges_are_accepted():
    cfg = load_config({**BASE, "fp16": {"enabled": True, "initial_scale_power": 127, "hysteresis": 1},
                       "aio": {"intra_op_parallelism": 256, "queue_depth": 1024, "block_size": 4096},
                       "optimizer": {"type": "AdamW", "params": {"lr": 0, "betas": [0, 0.999], "eps": 1e-30}}})
    assert cfg.fp16.initial_scale_power == 127


# ---------------------------------------------------------------- sizes written as floats (issue 21)
def test_near_integer_size_floats_are_rounded_and_reported():
    d = 1024
    raw = {**BASE, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0.9 * d**2,     # 943718.4
                                         "reduce_bucket_size": 5e8, "sub_group_size": 1e9}}
    cfg = load_config(raw)
    z = cfg.zero_optimization
    assert (z.prefetch_bucket_size, z.reduce_bucket_size, z.sub_group_size) == (943718, 500_000_000, 10**9)
    assert cfg.rounded == {"zero_optimization.stage3_prefetch_bucket_size": 943718.4}
    assert any("943718.4 rounded to 943718" in w for w in cfg.warnings)
    table = fate_table(translate(cfg, Env()))
    row = next(line for line in table.splitlines() if line.startswith("zero_optimization.stage3_prefetch_bucket"))
    assert "rounded from 943718.4" in row


@pytest.mark.parametrize("value", [0.5, 2.5, -943718.4, math.inf, math.nan, -1e9])
def test_far_from_integer_negative_or_non_finite_sizes_are_still_refused(value):
    problem({**BASE, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": value}},
            "zero_optimization.stage3_prefetch_bucket_size")


# ---------------------------------------------------------------- the reader
@pytest.mark.parametrize("name, data, words", [
    ("utf16.json", '{"train_batch_size": 8}'.encode("utf-16"), "UTF-16"),
    ("utf16be.json", '{"train_batch_size": 8}'.encode("utf-16-be"), "UTF-16"),
    ("latin1.json", '{"wandb": {"project": "caf\xe9"}}'.encode("latin-1"), "not UTF-8"),
    ("binary.bin", bytes(range(256)) * 4, "binary"),
    ("png.bin", b"\x89PNG\r\n\x1a\n" + bytes(range(1, 256)), "not UTF-8"),
    ("nul.json", b'{"a": 1}\x00', "binary"),
    ("deep.json", b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
    ("deep33.json", json.dumps(BASE | {"x": json.loads("[" * 33 + "1" + "]" * 33)}).encode(),
     "nested deeper"),
    ("bigint.json", b'{"train_batch_size": ' + b"9" * 4301 + b"}", "4300"),    # json's own digit limit
    ("bigint2.json", b'{"train_batch_size": ' + b"9" * 4300 + b"}", "4300-digit integer> is out of range"),
])
def test_bad_files_are_one_config_error(tmp_path, name, data, words):
    path = tmp_path / "ds.json"                # (the name is in the message: keep the words out of it)
    path.write_bytes(data)
    p = problem(str(path))
    assert words in p.message and len(str(p)) < 400, p


def test_utf8_with_bom_is_read(tmp_path):
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(BASE).encode())
    assert load_config(path).train_micro_batch_size_per_gpu == 2


def test_a_directory_is_named(tmp_path):
    assert "is a directory" in problem(str(tmp_path)).message


def test_dev_zero_is_refused_without_reading_it():
    # in a child with 1 GiB of address space: an unbounded read fails there (MemoryError), not in the test runner
    code = ("import resource; resource.setrlimit(resource.RLIMIT_AS, (2**30, 2**30))\n"
            "from fsdpzero.config import ConfigError, load_config\n"
            "try:\n    load_config('/dev/zero')\nexcept ConfigError as e:\n    print(e.problems[0].message)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[2])
    assert p.returncode == 0 and "not a regular file" in p.stdout, p.stderr[-2000:]


def test_a_file_over_the_cap_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.json"
    with open(path, "wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)      # sparse: no 16 MiB written
    assert "at most 16 MiB" in problem(str(path)).message


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    out = {}
    t = threading.Thread(target=lambda: out.update(p=problem(str(fifo))), daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():                          # unblock the reader so the test process can exit, then fail
        with open(fifo, "wb"):
            pass
        pytest.fail("reading a FIFO blocked")
    assert "not a regular file" in out["p"].message


def test_a_deep_dict_source_is_refused_before_any_recursive_pass():
    deep = cur = {}
    for _ in range(5000):
        cur["a"] = {}
        cur = cur["a"]
    assert f"deeper than {MAX_DEPTH}" in problem({**BASE, "x": deep}, "x").message


# ---------------------------------------------------------------- before any process group
def test_value_errors_come_before_the_process_group():
    from fsdpzero.api import wrap
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="fp16.hysteresis"):
        wrap(model, {**BASE, "fp16": {"enabled": True, "hysteresis": 0}, "optimizer": {"type": "AdamW"}})
    assert not dist.is_initialized()


def test_accepted_configs_still_translate():
    plan = build_plan({**BASE, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 943718.4}}, Env())
    assert plan.shard.stage == 3 and plan.shard.prefetch_bucket_size == 943718
    decision = next(d for d in plan.decisions if d.key == "zero_optimization.stage3_prefetch_bucket_size")
    assert (decision.value, decision.status) == (943718, "mapped") and "rounded from 943718.4" in decision.detail
