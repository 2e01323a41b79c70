"""`fsdpzero estimate MODEL_OR_CONFIG [--gpus N --nodes M --gpu-memory GiB]`: memory for params, gradients and
optimizer states under every ZeRO stage and offload option, before renting a GPU.

A named model (EXAMPLES) is counted from its shape alone, with neither transformers nor torch; a config.json is built
on the meta device by transformers (no weights, no download). Two numbers per option:
- `deepspeed`: DeepSpeed's own estimate -- the table its estimate_zero2/zero3_model_states_mem_needs_all_live print
  (same formulas, same 1.5 buffer factor on CPU), so a DeepSpeed user sees the figures they know; tested equal.
- `fsdpzero`: what fsdpzero's gradient paths hold at their peak (fsdpzero_bytes: fp32 master weights, grads and Adam
  states sharded by stage, the compute-dtype working set on top; stage 1's whole compute-dtype params and grads).
  This is the column the GPU test checks against measured `max_memory_allocated`, and the one "fits" uses.
Both exclude activations and the CUDA context: leave headroom for them (they grow with micro-batch x sequence).

With `--tp T` (tensor_parallel.autotp_size): the counts are one tp rank's (the plan's Linear layers split T ways,
as fsdpzero/parallel/tp_plan.py splits them: for Llama every block projection and an untied head; embeddings and
norms whole), ZeRO shards them over N / T data-parallel ranks, stage 1 counts as stage 2 (its layout under tp), and the
offload rows and DeepSpeed's columns are left out (fsdpzero refuses offload with tp; DeepSpeed's estimators know no
tp).

Symbols: P parameters; N = gpus x nodes ranks; B the largest transformer block (FSDP2 unit); R the parameters outside
blocks (embeddings, head, final norm: the root unit); L DeepSpeed's largest layer; c the compute dtype's bytes (2 for
bf16/fp16, 4 for fp32).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

GiB = 2**30

# Shapes of a few public models (their config.json values), so `fsdpzero estimate llama-3-8b` needs no file.
EXAMPLES: dict[str, dict] = {
    "gpt2": dict(model_type="gpt2", n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024),
    "gpt2-xl": dict(model_type="gpt2", n_embd=1600, n_layer=48, n_head=25, vocab_size=50257, n_positions=1024),
    "llama-0.9b": dict(model_type="llama", hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                       num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
    "llama-3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False),
    "llama-2-70b": dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
}


@dataclass(frozen=True)
class ModelCounts:
    total: int           # P, shared (tied) parameters counted once
    largest_layer: int   # DeepSpeed's "largest layer": most parameters owned directly by one module
    largest_block: int   # B: the biggest transformer block (fully_shard unit)
    root: int            # R: parameters outside the blocks


@dataclass(frozen=True)
class Row:
    stage: int
    option: str          # "none" | "offload_optimizer=cpu" | "offload_param+optimizer=cpu" | "...=nvme"
    zero_init: bool | None
    gpu: float           # bytes per GPU, fsdpzero
    cpu_node: float      # bytes of host memory per node, fsdpzero
    ds_gpu: float | None = None   # DeepSpeed's estimate (None: DeepSpeed gives none for this option)
    ds_cpu_node: float | None = None


def counts_of(model) -> ModelCounts:
    params = {id(p): p.numel() for p in model.parameters()}       # by identity: meta tensors share data_ptr 0
    largest_layer = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    in_blocks = {id(p): p.numel() for b in blocks for p in b.parameters()}
    largest_block = max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0)
    total = sum(params.values())
    return ModelCounts(total, largest_layer, largest_block, total - sum(in_blocks.values()))


def example_counts(d: dict) -> ModelCounts:
    """Counts of an EXAMPLES entry from its shape alone, as transformers' LlamaForCausalLM / GPT2LMHeadModel build it
    (tests/cli/test_estimate.py checks them equal to the meta-device model): `fsdpzero estimate llama-3-8b` needs
    neither transformers nor torch."""
    if d["model_type"] == "llama":
        H, I, V, L = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["num_hidden_layers"]
        hd = H // d["num_attention_heads"]
        attn = H * hd * (2 * d["num_attention_heads"] + 2 * d["num_key_value_heads"])   # q, o; k, v
        block = attn + 3 * H * I + 2 * H                                                 # + gate/up/down + 2 norms
        head = 0 if d["tie_word_embeddings"] else V * H
        root = V * H + H + head                                                           # embed, final norm, head
        return ModelCounts(root + L * block, max(V * H, H * I), block, root)
    if d["model_type"] == "gpt2":
        E, V, L, T = d["n_embd"], d["vocab_size"], d["n_layer"], d["n_positions"]
        block = 4 * E + (3 * E * E + 3 * E) + (E * E + E) + (4 * E * E + 4 * E) + (4 * E * E + E)   # 2 lns, attn, mlp
        root = V * E + T * E + 2 * E                                                      # wte (= lm_head), wpe, ln_f
        return ModelCounts(root + L * block, max(V * E, T * E, 4 * E * E + 4 * E), block, root)
    raise ValueError(f"no parameter count for model_type {d['model_type']!r}")


def example_tp_counts(d: dict, tp: int) -> ModelCounts:
    """One tp rank's counts of an EXAMPLES entry under transformers' tp_plan (tests/cli/test_estimate.py checks them
    against the meta-device model's plan, fsdpzero.parallel.tp_plan)."""
    if d["model_type"] != "llama":
        raise ValueError(f"--tp {tp}: {d['model_type']} has no transformers tp_plan (fsdpzero would refuse it "
                         "without tensor_parallel.partition_config); estimate a config.json with one")
    H, I, V, L = d["hidden_size"], d["intermediate_size"], d["vocab_size"], d["num_hidden_layers"]
    tied = d["tie_word_embeddings"]
    for name, value in (("num_attention_heads", d["num_attention_heads"]), ("num_key_value_heads",
                        d["num_key_value_heads"]), ("intermediate_size", I)) + ((("vocab_size", V),) if not tied else ()):
        if value % tp:
            raise ValueError(f"--tp {tp}: {name} = {value} does not split evenly over {tp} tp ranks")
    hd = H // d["num_attention_heads"]
    attn = H * hd * (2 * d["num_attention_heads"] + 2 * d["num_key_value_heads"]) // tp
    block = attn + 3 * H * I // tp + 2 * H
    root = V * H + H + (0 if tied else V * H // tp)
    return ModelCounts(root + L * block, max(V * H, H * I // tp), block, root)


def tp_counts_of(model, tp: int) -> ModelCounts:
    """One tp rank's counts of a (meta-device) model: the Linear layers fsdpzero's plan shards divide by tp."""
    from fsdpzero.parallel.tp_plan import resolve_tp_plan
    from fsdpzero.plan.types import TensorParallelPlan
    styles = resolve_tp_plan(model, TensorParallelPlan(size=tp), allow_meta=True)
    modules = dict(model.named_modules())
    split = {}
    for name, style in styles.items():
        lin = modules[name]
        split[id(lin.weight)] = tp
        if lin.bias is not None and style != "row":   # a row layer's bias is added once, after the all-reduce
            split[id(lin.bias)] = tp
    size = {id(p): p.numel() // split.get(id(p), 1) for p in model.parameters()}
    largest_layer = max((sum(size[id(p)] for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    block_names = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_names]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    largest_block = max((sum(size[id(p)] for p in b.parameters()) for b in blocks), default=0)
    total = sum(size.values())
    return ModelCounts(total, largest_layer, largest_block, total - sum(size[i] for i in in_blocks))


# Configs whose layer or expert count is beyond any released model are refused before a module is built: the count
# builds every module on the meta device (100,000 layers took minutes).
MAX_MODULES = {"num_hidden_layers": 1024, "num_local_experts": 1024, "num_experts": 1024, "n_routed_experts": 1024}


def one_line(e: BaseException | str, limit: int = 400) -> str:
    """An exception's message on one line (transformers' span several), at most `limit` characters."""
    text = " ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
    text = text if isinstance(e, str) else f"{type(e).__name__}: {text}".rstrip(": ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_model_config(name_or_path: str):
    """A transformers config from config.json (file or folder), a shipped conf/model/*.yaml name, or EXAMPLES."""
    p = Path(name_or_path).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file() and p.stat().st_size > 16 * 2**20:     # a config.json is a few KiB; do not parse a weights file
        raise ValueError(f"{name_or_path} is {p.stat().st_size} bytes: not a transformers config.json")
    shipped = Path(__file__).resolve().parents[2] / "conf" / "model" / f"{name_or_path}.yaml"   # a source checkout
    known = p.is_file() or shipped.is_file() or name_or_path in EXAMPLES
    if not known:
        names = sorted(EXAMPLES) + sorted(q.stem for q in shipped.parent.glob("*.yaml"))
        raise ValueError(f"{name_or_path!r} is neither a config.json (file or folder) nor a known example "
                         f"({', '.join(names)})")
    try:
        import transformers
    except ImportError:
        raise ValueError(f"{name_or_path}: reading a model config needs transformers (pip install 'fsdpzero[hf]'); "
                         f"the named models ({', '.join(sorted(EXAMPLES))}) need nothing") from None
    try:
        if p.is_file():
            return transformers.AutoConfig.from_pretrained(str(p.parent) if p.name == "config.json" else str(p))
        if shipped.is_file():
            import yaml
            d = yaml.safe_load(shipped.read_text())
            cls = getattr(transformers, d.pop("_target_").rsplit(".", 1)[1])
            return cls(**d)
        d = dict(EXAMPLES[name_or_path])
        return transformers.CONFIG_MAPPING[d.pop("model_type")](**d)
    except Exception as e:   # transformers' own validation (a str hidden_size, a list for a config): one line
        raise ValueError(f"{name_or_path}: not a usable transformers config: {one_line(e)}") from None


def count_model(name_or_path: str, tp: int = 1) -> ModelCounts:
    """The model's counts; with tp > 1, one tensor-parallel rank's."""
    if name_or_path in EXAMPLES and not Path(name_or_path).expanduser().exists():
        d = EXAMPLES[name_or_path]
        return example_counts(d) if tp == 1 else example_tp_counts(d, tp)
    config = load_model_config(name_or_path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, limit in MAX_MODULES.items():
        value = getattr(text, key, None)
        if isinstance(value, int) and value > limit:
            raise ValueError(f"{name_or_path}: {key} = {value}: more than {limit} is beyond any released model "
                             "(estimate builds every module on the meta device); check the config")
    import torch
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as e:   # negative sizes, heads that do not divide the width, an unknown architecture, ...
        raise ValueError(f"{name_or_path}: transformers cannot build a model from this config: {one_line(e)}") \
            from None
    return counts_of(model) if tp == 1 else tp_counts_of(model, tp)


# DeepSpeed's formulas (runtime/zero/stage_1_and_2.py and stage3.py, 0.19.8), restated: bytes.
def deepspeed_zero2(P: int, gpus: int, nodes: int, cpu_offload: bool, buf: float = 1.5) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU) for stage 1/2."""
    n = gpus * nodes
    if cpu_offload:
        return int(P * max(4 * n, 16) * buf), int(2 * P)
    return int(P * 4 * gpus * buf), int(2 * P + int(18 * P / n))


def deepspeed_zero3(P: int, largest_layer: int, gpus: int, nodes: int, cpu_offload: bool, offload_params: bool,
                    zero_init: bool, buf: float = 1.5) -> tuple[int, int]:
    """(cpu bytes per node, gpu bytes per GPU) for stage 3."""
    n, per_node = gpus * nodes, 1 / nodes
    layer = 4 * largest_layer
    if cpu_offload and offload_params:
        gpu = layer
        cpu = P * 18 * per_node * buf if zero_init else P * max(4 * gpus, 18 * per_node) * buf
    elif cpu_offload:
        gpu = layer + int(2 * P / n)
        cpu = P * 16 * per_node * buf if zero_init else P * max(4 * gpus, 16 * per_node) * buf
    else:
        gpu = layer + int(18 * P / n)
        cpu = largest_layer * 4 * gpus * buf if zero_init else P * 4 * gpus * buf
    return int(cpu), int(gpu)


REDUCE_BUCKET = 500_000_000   # zero_optimization.reduce_bucket_size's default (elements, counted across ranks)


def stage1_reduce_transient(c: ModelCounts, n: int, cb: int) -> int:
    """Stage 1's boundary reduction packs runs of grads into compute-dtype buffers, two runs in flight, while later
    runs' grads still live: with the ramped runs (bucket/8, /4, /2 first; ops/fsdpzero_ops/stage1/layout.py) about
    cb x (bucket/2 + bucket/4 x (1 + 1/n) - bucket/4 - bucket/8), at least the largest layer's run (0.68 GB measured
    on 2 H200s at 0.89 B, this 0.50 GB; stage 1 rows then within 5 %)."""
    run = min(REDUCE_BUCKET, c.total)
    return max(cb * c.largest_layer, cb * (run // 2 + run // 4 * (n + 1) // n - run // 4 - run // 8))


def fsdpzero_bytes(c: ModelCounts, stage: int, option: str, n: int, gpus: int, compute_bytes: int,
                   ratio: float = 1.0) -> tuple[int, int]:
    """(gpu bytes, host bytes per node) of model states, as fsdpzero's gradient paths hold them at their peak.

    Stage 0 and FSDP2 stages 2/3: fp32 sharded params 4 + grads 4 + Adam 8 bytes/param, sharded as the stage says,
    plus the unsharded working set in the compute dtype. Stage 1 (ops/fsdpzero_ops/stage1/): whole compute-dtype
    params and the whole compute-dtype grads they accumulate, until the boundary's reduce-scatter packs them into the
    fp32 grad shard (allocated first, 4/N), plus the fp32 master and Adam shards (12/N) and the first reduce bucket.
    Optimizer offload keeps only compute-dtype shards (params, grads) on the GPU; the host has the fp32 master and
    Adam (12/N) plus the pinned copy buffers (2 + 2 bytes/param; stage 1: its pinned fp32 grad shard, 4).
    `ratio` (offload_optimizer.ratio, option offload_optimizer=cpu): the CPU keeps that fraction of the fp32
    masters and moments, the GPU the rest."""
    P, B, R, L, cb = c.total, c.largest_block, c.root, c.largest_layer, compute_bytes
    # root unit gathered + current and prefetched block + one block's grads; one rank has nothing to all-gather, and
    # FSDP2 then fills each block's unsharded params when it runs (wait_for_unshard), with none prefetched ahead
    working3 = cb * (R + (3 if n > 1 else 2) * B)
    offload = option == "offload_optimizer=cpu"
    if stage == 0:   # the (W, 1) mesh keeps the compute-dtype copy of every param alive through the step
        gpu, host = 16 * P + (cb * P if cb < 4 else 0) + cb * B, 0
    elif stage == 1:   # masters, their grad and Adam on the CPU with offload; the whole params and grads stay
        gpu = 2 * cb * P + stage1_reduce_transient(c, n, cb) + (0 if offload else 16 * P // n)
        return int(gpu), int(16 * P // n * gpus if offload else 0)
    elif stage == 2:
        # unsharded params live from forward into backward while the grads are still None (zero_grad frees them)
        # and each block's go as its grad shard arrives: the peak is the larger of that and the optimizer step
        gpu, host = max(16 * P // n, 12 * P // n + cb * P) + cb * B, 0
    else:
        gpu, host = 16 * P // n + working3, 0
    if offload:                                         # compute-dtype param and grad shards stay on the GPU
        shards = 2 * cb * P // n
        # stage 2: the unsharded params from forward to the start of backward (grads still None), the param shards
        # dropped meanwhile (offload_drop_shards: CUDA, no gradient accumulation; docs/offload.md), or the step's
        # param and grad shards
        # (the root unit, embeddings and head, keeps its compute-dtype shard through the forward)
        gpu = max(shards, cb * P + cb * B + cb * R) if stage == 2 else shards + working3
        host = 16 * P // n * gpus
        if ratio < 1.0:   # partial offload: fp32 master + moments (12 B/param) of the rest on the GPU; at stage 2
            # the units holding them also keep their compute-dtype shards (fsdp2_internals.DroppableShards drops only
            # units stepped wholly on the CPU)
            extra = 12 + (cb if stage == 2 else 0)
            gpu, host = gpu + int(extra * P * (1 - ratio) / n), int(16 * P * ratio / n * gpus)
    elif option.startswith("offload_param+optimizer"):  # CPUOffloadPolicy: all sharded state in host memory
        # stage 3: the backward adds the root unit's unsharded grads (reduced last) to the forward's working set
        gpu = (cb * P + cb * B) if stage == 2 else working3 + cb * R
        host = 0 if option.endswith("nvme") else (12 + 2 * cb) * P // n * gpus
    return int(gpu), int(host)


def table(c: ModelCounts, gpus: int = 1, nodes: int = 1, compute_bytes: int = 2, buf: float = 1.5,
          ratio: float = 1.0, tp: int = 1) -> list[Row]:
    """Every stage and offload option; with `ratio` < 1 also partial optimizer offload at stages 2 and 3 (no
    DeepSpeed figure: its estimators ignore ratio). With tp > 1 (c: one tp rank's counts): stages 0-3 without
    offload, sharded over the gpus x nodes / tp data-parallel ranks, stage 1 on stage 2's layout."""
    n = gpus * nodes
    if tp > 1:
        return [Row(stage, "none", None, *fsdpzero_bytes(c, 2 if stage == 1 else stage, "none", n // tp, gpus,
                                                         compute_bytes)) for stage in (0, 1, 2, 3)]
    rows = []
    g, h = fsdpzero_bytes(c, 0, "none", n, gpus, compute_bytes)
    rows.append(Row(0, "none", None, g, h))
    for stage in (1, 2):
        for option, off in (("offload_optimizer=cpu", True), ("none", False)):
            g, h = fsdpzero_bytes(c, stage, option, n, gpus, compute_bytes)
            ds_cpu, ds_gpu = deepspeed_zero2(c.total, gpus, nodes, off, buf)
            rows.append(Row(stage, option, None, g, h, ds_gpu, ds_cpu))
    for option, off, off_p in (("offload_param+optimizer=cpu", True, True), ("offload_optimizer=cpu", True, False),
                               ("none", False, False)):
        g, h = fsdpzero_bytes(c, 3, option, n, gpus, compute_bytes)
        for zero_init in (True, False):
            ds_cpu, ds_gpu = deepspeed_zero3(c.total, c.largest_layer, gpus, nodes, off, off_p, zero_init, buf)
            rows.append(Row(3, option, zero_init, g, h, ds_gpu, ds_cpu))
    g, h = fsdpzero_bytes(c, 3, "offload_param+optimizer=nvme", n, gpus, compute_bytes)
    rows.append(Row(3, "offload_param+optimizer=nvme", None, g, h))
    if ratio < 1.0:
        for stage in (2, 3):
            g, h = fsdpzero_bytes(c, stage, "offload_optimizer=cpu", n, gpus, compute_bytes, ratio)
            rows.append(Row(stage, f"offload_optimizer=cpu,ratio={ratio:g}", None, int(g), int(h)))
    return rows


def add_arguments(parser) -> None:
    parser.add_argument("model", help="config.json (or its folder), a conf/model name, or one of: "
                        + ", ".join(sorted(EXAMPLES)))
    from fsdpzero.cli.args import fraction, positive_float, positive_int
    parser.add_argument("--gpus", type=positive_int, default=1, help="GPUs per node (default 1)")
    parser.add_argument("--nodes", type=positive_int, default=1, help="nodes (default 1)")
    parser.add_argument("--gpu-memory", type=positive_float, default=None,
                        help="GiB per GPU: mark the options that fit")
    parser.add_argument("--cpu-memory", type=positive_float, default=None,
                        help="GiB of host memory per node, likewise")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16", help="compute dtype")
    parser.add_argument("--buffer-factor", type=positive_float, default=1.5,
                        help="DeepSpeed's additional_buffer_factor")
    parser.add_argument("--ratio", type=fraction, default=1.0,
                        help="offload_optimizer.ratio (the CPU's fraction, in [0, 1]) < 1: also show partial "
                        "optimizer offload (stages 2 and 3)")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor_parallel.autotp_size: tensor-parallel ranks (divides gpus x nodes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    import sys
    if args.gpus < 1 or args.nodes < 1:
        print(f"fsdpzero estimate: error: --gpus {args.gpus} --nodes {args.nodes}: both must be >= 1",
              file=sys.stderr)
        return 2
    if (args.gpus * args.nodes) % args.tp:
        print(f"fsdpzero estimate: error: --tp {args.tp} does not divide the {args.gpus * args.nodes} GPUs "
              "(gpus x nodes)", file=sys.stderr)
        return 2
    try:
        c = count_model(args.model, args.tp)
    except (ValueError, OSError) as e:
        print(f"fsdpzero estimate: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    rows = table(c, args.gpus, args.nodes, 4 if args.dtype == "fp32" else 2, args.buffer_factor, args.ratio,
                 args.tp)

    def fits(r: Row) -> bool | None:
        if args.gpu_memory is None and args.cpu_memory is None:
            return None
        return ((args.gpu_memory is None or r.gpu <= args.gpu_memory * GiB)
                and (args.cpu_memory is None or r.cpu_node <= args.cpu_memory * GiB))

    if args.json:
        print(json.dumps({"model": args.model, "counts": c.__dict__, "gpus": args.gpus, "nodes": args.nodes,
                          "tp": args.tp,
                          "rows": [dict(r.__dict__, fits=fits(r)) for r in rows]}, indent=2))
        return 0
    gb = lambda x: "      -" if x is None else f"{x / GiB:7.2f}"  # noqa: E731
    print(f"{args.model}: {c.total / 1e6:.1f}M params (largest layer {c.largest_layer / 1e6:.1f}M, largest block "
          f"{c.largest_block / 1e6:.1f}M, outside blocks {c.root / 1e6:.1f}M); {args.nodes} node(s) x {args.gpus} "
          f"GPU(s)" + (f", tp {args.tp} x dp {args.gpus * args.nodes // args.tp} (counts per tp rank)"
                        if args.tp > 1 else "") + f"; compute {args.dtype}; GiB, model states only (no activations)")
    print(" stage | option                            | init | fsdpzero GPU | host/node | DeepSpeed GPU | host/node"
          + (" | fits" if fits(rows[0]) is not None else ""))
    for r in rows:
        init = "  -  " if r.zero_init is None else ("meta " if r.zero_init else "full ")
        verdict = fits(r)
        print(f"   {r.stage}   | {r.option:33} | {init}|      {gb(r.gpu)} |   {gb(r.cpu_node)} |       {gb(r.ds_gpu)}"
              f" |   {gb(r.ds_cpu_node)}" + ("" if verdict is None else (" | yes" if verdict else " | no")))
    if fits(rows[0]) is not None:
        ok = [r for r in rows if fits(r)]
        best = min(ok, key=lambda r: (r.stage, r.option != "none", r.gpu)) if ok else None
        print("fits: " + (f"stage {best.stage} with {best.option} is the least sharded option that fits"
                          if best else "no option fits: add GPUs or nodes, or use NVMe offload on a bigger host"))
    print(LEGEND)
    return 0


LEGEND = """columns (GiB of model states: weights, gradients, optimizer states; no activations, no CUDA context):
  fsdpzero GPU   peak per GPU under fsdpzero: stage 0 and 2/3 hold fp32 master weights + grads + Adam (16 bytes/param,
                 sharded by the stage) and the compute-dtype copies in use; stage 1 holds the whole compute-dtype
                 weights and grads plus 16/N bytes/param of fp32 shards; offload keeps only compute-dtype shards
  host/node      host memory per node for what is offloaded (fp32 masters, Adam, pinned copy buffers)
  DeepSpeed      what DeepSpeed 0.19.8's own estimator prints for the same option ("-": it gives none), to compare
  fits           the fsdpzero columns against --gpu-memory / --cpu-memory
init: meta = sharded/meta-device init (DeepSpeed zero_init=1, fsdpzero.hf.from_pretrained); full = every rank builds
  the whole model first (only changes DeepSpeed's host figure)"""
