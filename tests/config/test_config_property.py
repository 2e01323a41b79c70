"""Property: mutated corpus configs (keys dropped, renamed, retyped, set to random values or "auto") end in a valid
plan or in one ConfigError whose problems all name a key; no other exception escapes. 4 x 520 = 2,080 cases."""
import copy
import json
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings, strategies as st

from fsdpzero.config import ConfigError
from fsdpzero.plan import Env, Plan
from fsdpzero.plan.translate import build_plan

CORPUS = [json.loads(p.read_text())
          for p in sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json"))]
SETTINGS = settings(max_examples=520, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10), st.integers(-2**63, 2**63),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=5),
                    st.sampled_from(["auto", "cpu", "nvme", "none", "fp16", "bf16", "Adam", "WarmupLR", "1e3", ""]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=2)),
                      max_leaves=4)


def _paths(node, prefix=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield prefix + (k,)
            yield from _paths(v, prefix + (k,))


def _parent(cfg, path):
    node = cfg
    for k in path[:-1]:
        node = node[k]
    return node


def mutate(data, cfg, n):
    for _ in range(n):
        paths = list(_paths(cfg))
        kind = data.draw(st.sampled_from(["drop", "rename", "retype", "value", "auto", "add"]))
        if not paths or kind == "add":
            target = cfg if not paths else data.draw(st.sampled_from([cfg] + [
                v for p in paths if isinstance(v := _parent(cfg, p)[p[-1]], dict)]))
            target[data.draw(st.text(max_size=12))] = data.draw(values)
            continue
        path = data.draw(st.sampled_from(paths))
        parent, key = _parent(cfg, path), path[-1]
        if kind == "drop":
            del parent[key]
        elif kind == "rename":
            i = data.draw(st.integers(0, max(0, len(key) - 1)))
            new = key[:i] + data.draw(st.sampled_from(["", "_", "s", "e", key[i:i + 1] * 2])) + key[i + 1:]
            parent[new] = parent.pop(key)
        elif kind == "retype":
            v = parent[key]
            parent[key] = {"x": v} if not isinstance(v, dict) else [v] if data.draw(st.booleans()) else str(v)
        elif kind == "value":
            parent[key] = data.draw(values)
        else:
            parent[key] = "auto"
    return cfg


def check_one(cfg, world, ctx, hf):
    try:
        plan = build_plan(cfg, Env(world_size=world), context=ctx, hf_defaults=hf)
    except ConfigError as e:
        event("ConfigError")                                 # --hypothesis-show-statistics shows the mix
        assert e.problems and all(isinstance(p.key, str) and p.message for p in e.problems)
        assert "Traceback" not in str(e)
        return
    event("plan" + (" (unsupported)" if plan.unsupported else ""))
    assert isinstance(plan, Plan)
    json.dumps(plan.to_dict())                               # the plan is plain data
    assert all(d.status in ("mapped", "approximated", "noop", "unsupported") for d in plan.decisions)
    b = plan.batch
    assert b.train_batch_size == b.micro_batch_size * b.gradient_accumulation_steps * world


CTX = st.fixed_dictionaries({}, optional={"hidden_size": st.integers(1, 8192), "max_steps": st.integers(-1, 10**5),
                                          "per_device_train_batch_size": st.integers(1, 64),
                                          "learning_rate": st.floats(0, 1), "warmup_steps": st.floats(0, 100)})


@SETTINGS
@given(st.data(), st.sampled_from(range(len(CORPUS))), st.integers(1, 3))
def test_single_mutations(data, i, n):
    check_one(mutate(data, copy.deepcopy(CORPUS[i]), n), 8, {"hidden_size": 4096}, True)


@SETTINGS
@given(st.data(), st.sampled_from(range(len(CORPUS))), st.integers(2, 6), st.integers(1, 64), CTX, st.booleans())
def test_many_mutations_any_world_and_context(data, i, n, world, ctx, hf):
    check_one(mutate(data, copy.deepcopy(CORPUS[i]), n), world, ctx, hf)


@SETTINGS
@given(st.dictionaries(st.sampled_from(["train_batch_size", "train_micro_batch_size_per_gpu", "zero_optimization",
                                        "fp16", "bf16", "optimizer", "scheduler", "gradient_clipping", "aio",
                                        "activation_checkpointing", "checkpoint", "bfloat16", "communication_data_type",
                                        "tensorboard", "pipeline", "torch_autocast"]), values, max_size=6),
       st.integers(1, 16))
def test_random_top_level_sections(cfg, world):
    check_one(cfg, world, {}, False)


SECTIONS = {"zero_optimization": ["stage", "offload_param", "offload_optimizer", "stage3_prefetch_bucket_size",
                                  "reduce_bucket_size", "zero_hpz_partition_size", "mics_shard_size", "cpu_offload",
                                  "sub_group_size", "overlap_comm", "zenflow"],
            "optimizer": ["type", "params"], "scheduler": ["type", "params"],
            "fp16": ["enabled", "loss_scale", "loss_scale_window", "min_loss_scale", "hysteresis"],
            "bf16": ["enabled", "check_grad_overflow", "bf16_master_weights_and_grads"]}


@SETTINGS
@given(st.data(), st.integers(1, 8))
def test_random_values_for_known_keys(data, world):
    cfg = {"train_micro_batch_size_per_gpu": data.draw(st.one_of(st.integers(-1, 8), scalars))}
    for section, keys in SECTIONS.items():
        if data.draw(st.booleans()):
            cfg[section] = data.draw(st.dictionaries(st.sampled_from(keys), st.one_of(scalars, values), max_size=4))
    check_one(cfg, world, {"hidden_size": 64}, data.draw(st.booleans()))
