"""DeepSpeed's `optimizer.type: "Muon"` (DeepSpeed 0.19.8's MuonWithAuxAdam) over FSDP2 shards.

DeepSpeed's split (deepspeed.set_optimizer_flags): a parameter whose layer shape has >= 2 dims and whose name has
neither "embed" nor "lm_head" gets Muon; every other one (embeddings, the head, biases, norms) the auxiliary AdamW.
A Muon parameter of more than 2 dims is, as DeepSpeed 0.19.8's muon_update takes it whole at every stage, a batch of
matrices over its leading dims (stacked MoE experts (E, out, in), a Conv1d filter (out, in, k) as `out` matrices of
(in, k)): Newton-Schulz per matrix of the batch, the aspect scale from the last two dims. A 4-D one (a Conv2d filter)
is refused (check_muon_shapes): muon_update views it as 2-D and then fails to put the update back in its shape.
Config keys: `lr` for both halves, `muon_lr` / `adam_lr` for one; Muon takes `momentum` (0.95), `weight_decay` (0),
`ns_method` ("gram"); AdamW takes `betas` ((0.9, 0.95)), `eps` (1e-10), `weight_decay` (0). Defaults as DeepSpeed's.

Muon's update, per matrix (DeepSpeed's muon_update: nesterov, 5 Newton-Schulz steps):
    m = lerp(m, g, 1 - momentum);  u = lerp(g, m, momentum);  u = NS(u) * sqrt(max(1, rows / cols))
    p *= 1 - lr * weight_decay;  p -= lr * u
The momentum is elementwise and stays sharded like the parameter. Newton-Schulz needs the whole matrix: matrix i's
nesterov blend is gathered to one owner rank (i mod the shard group's size), which alone runs Newton-Schulz, and the
result is scattered back so each rank gets the rows of its shard. The step's Newton-Schulz runs are batched
(Orthogonalizer): each owner runs one per matrix shape on the stack of its matrices of that shape, a bounded window of
matrices at a time, every gather of a window issued before and every scatter after.

Gradient clipping, as DeepSpeed 0.19.8 orders it: at ZeRO 1-3 each Muon gradient becomes its orthogonalized update
before the global norm (MuonGradPath), so the norm is taken over the Muon updates and the AdamW half's gradients and
the clip factor scales both; the momentum moves with the unclipped gradient. At ZeRO 0 (no ZeRO optimizer) DeepSpeed
clips the raw gradients and Muon runs inside the step, as torch optimizers do.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from fsdpzero.dist import local_tensor
from fsdpzero.optim.grad_path import GradPath

MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")   # what a Muon half's group takes from the config
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")            # and the AdamW half's
NS_METHODS = ("gram", "standard")
NS_STEPS = 5
_NS_COEFFS = (3.4445, -4.7750, 2.0315)

ns_calls = 0     # matrices orthogonalized in this process (tests check each matrix runs once per step, on one rank)
ns_batches = 0   # Newton-Schulz runs in this process, each over a batch of same-shape matrices (one per owner and
                 # shape in a window: Orthogonalizer)
# Orthogonalizer's bound on the whole matrices one owner takes into Newton-Schulz at once (at 4 bytes an element): its
# transient memory is a few times this (the stack, the iteration's fp32/fp16 copies, the result; ~5x in fp32)
NS_WINDOW_BYTES = 512 << 20


def is_muon_param(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's rule: matrices (>= 2 dims), except embeddings and the output head."""
    return p.ndim >= 2 and not any(word in name.lower() for word in ("embed", "lm_head"))


def check_muon_shapes(named: Iterable[tuple[str, torch.Size]]) -> None:
    """Refuses a 4-D Muon parameter (DeepSpeed 0.19.8 cannot step one: muon_update views a 4-D update as
    (out, in * kh * kw), runs Newton-Schulz, and its torch.where against the 4-D gradient does not broadcast); one
    line naming the parameter, its shape and the fix. Every other shape of >= 2 dims is stepped as DeepSpeed does."""
    for name, shape in named:
        if len(shape) == 4:
            raise ValueError(f"Muon parameter {name!r} has shape {tuple(shape)}: a 4-D (conv2d) filter, which "
                             "DeepSpeed 0.19.8's Muon cannot step either (muon_update fails on it); use optimizer.type "
                             "AdamW for this model, or hold the filter as a 2-D (out, in*kh*kw) parameter")


def check_muon_model(model: torch.nn.Module) -> None:
    """check_muon_shapes over the parameters DeepSpeed's split gives Muon; from shapes alone, so it runs before any
    process group, with the same error on every rank."""
    check_muon_shapes((n, p.shape) for n, p in model.named_parameters() if p.requires_grad and is_muon_param(n, p))


def tag_muon_params(model: torch.nn.Module) -> None:
    """Set `use_muon` on every parameter, as deepspeed.initialize does, before sharding changes names and shapes."""
    for name, p in model.named_parameters():
        p.use_muon = is_muon_param(name, p)


def check_muon(params: dict[str, Any]) -> None:
    """DeepSpeed's checks on a Muon config, before any process group exists."""
    method = params.get("ns_method", "gram")
    if method not in NS_METHODS:
        raise ValueError(f"config key 'optimizer.params.ns_method' = {method!r}: use one of {list(NS_METHODS)}")
    if params.get("per_head_muon"):
        raise ValueError("config key 'optimizer.params.per_head_muon' = true is not implemented in fsdpzero (per-head "
                         "Newton-Schulz of attention projections); remove it to orthogonalize whole matrices")


def muon_param_groups(groups: list[dict], params: dict[str, Any]) -> list[dict]:
    """DeepSpeed's DeepSpeedEngine._muon_param_groups: each incoming group splits into its Muon and AdamW halves;
    settings resolve config value, then muon_lr / adam_lr, then the group's own. Every param has `use_muon`."""
    halves = []
    for use_muon, keys, lr_key in ((True, MUON_KEYS, "muon_lr"), (False, ADAM_KEYS, "adam_lr")):
        defaults = {k: params[k] for k in keys if k in params}
        if lr_key in params:
            defaults["lr"] = params[lr_key]
        halves.append((use_muon, "muon" if use_muon else "adam", keys, defaults))
    out = []
    for index, group in enumerate(groups):
        overrides = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        for use_muon, label, keys, defaults in halves:
            half = [p for p in trainable if bool(p.use_muon) is use_muon]
            if not half:
                continue
            settings = {**defaults, **{k: v for k, v in overrides.items() if k in keys}}
            prefix = overrides.get("name") or (f"group{index}" if len(groups) > 1 else None)
            out.append(dict(params=half, use_muon=use_muon, name=f"{prefix}-{label}-params" if prefix
                            else f"{label}-params", **settings))
    return out


# -- Newton-Schulz, as DeepSpeed 0.19.8's original_muon.py (itself Keller Jordan's, MIT) ------------------------------

def ns_compute_dtype(method: str, device: torch.device) -> torch.dtype:
    """DeepSpeed's ns_compute_dtype: "gram" in fp16 where the accelerator has it (CUDA; a CPU with mkldnn fp16),
    "standard" in bf16; else fp32."""
    if method == "gram":
        if device.type == "cuda":
            return torch.float16
        try:
            return torch.float16 if torch.ops.mkldnn._is_mkldnn_fp16_supported() else torch.float32
        except Exception:   # no mkldnn: DeepSpeed's CPU accelerator says fp16 is unsupported
            return torch.float32
    return torch.bfloat16


def _newton_schulz5(G: torch.Tensor, steps: int) -> torch.Tensor:
    a, b, c = _NS_COEFFS
    X = G.to(ns_compute_dtype("standard", G.device))
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def _gram_newton_schulz(G: torch.Tensor, steps: int) -> torch.Tensor:
    """Newton-Schulz on the small Gram matrix X X^T, restarted at iteration 2 (fp16 stability)."""
    a, b, c = _NS_COEFFS
    compute_dtype = ns_compute_dtype("gram", G.device)
    X = G.to(torch.float32 if G.dtype == torch.float16 else G.dtype)
    if G.size(-2) > G.size(-1):
        X = X.mT
    n, m = X.size(-2), X.size(-1)
    X = (X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(compute_dtype)
    if m <= n:   # square: no saving, the standard iteration
        for _ in range(steps):
            A = X @ X.mT
            B = b * A + c * A @ A
            X = a * X + B @ X
        return X.mT if G.size(-2) > G.size(-1) else X
    R = X @ X.mT
    Q = None
    restart_at = 2
    for i in range(steps):
        if i == restart_at and i != 0:
            X = Q @ X
            R = X @ X.mT
            Q = None
        Z = b * R + c * R @ R
        if Q is None:
            Q = Z.clone()
            Q.diagonal(dim1=-2, dim2=-1).add_(a)
        else:
            Q = a * Q + Z @ Q
        if i < steps - 1 and (i + 1) != restart_at:
            RZ = a * R + Z @ R
            R = a * RZ + Z @ RZ
    return X.mT @ Q.mT if G.size(-2) > G.size(-1) else Q @ X


def orthogonalize(update: torch.Tensor, ns_method: str = "gram", steps: int = NS_STEPS) -> torch.Tensor:
    """The whole-matrix part of DeepSpeed's muon_update: Newton-Schulz, times sqrt(max(1, rows / cols)), in the
    update's dtype. `update` may be a batch of same-shape matrices (..., rows, cols): every op of both iterations
    works on the last two dims (mT, norm over (-2, -1), diagonal(dim1=-2, dim2=-1), batched matmul)."""
    global ns_calls, ns_batches
    ns_calls += update.shape[:-2].numel()
    ns_batches += 1
    rows, cols = update.size(-2), update.size(-1)
    out = _gram_newton_schulz(update, steps) if ns_method == "gram" else _newton_schulz5(update, steps)
    return (out * (math.sqrt(rows / cols) if rows > cols else 1.0)).to(update.dtype)


def orthogonalize_batch(updates: list[torch.Tensor], ns_method: str = "gram") -> list[torch.Tensor]:
    """orthogonalize() of each matrix (all of one shape, dtype and device), in one Newton-Schulz run over their
    stack. Same-shape, not same-orientation: a tall and a wide matrix would share the oriented iteration but not
    its layout (NS transposes a tall one by a view), and the per-matrix arithmetic would change in the last bits."""
    if len(updates) == 1:
        return [orthogonalize(updates[0], ns_method)]
    return list(orthogonalize(torch.stack(updates), ns_method).unbind(0))


# -- whole matrices from shards ----------------------------------------------------------------------------------------

def _shard_layout(p: torch.Tensor):
    """(process group, shard rows per rank) of a parameter sharded on dim 0 (FSDP2's Shard(0), optionally with
    replicated mesh dims: HSDP, where each replica group runs its own owner's Newton-Schulz), or (None, None) for a
    whole tensor (replicated: a DTensor Replicate, a shard group of one, or a plain tensor)."""
    from torch.distributed.tensor import DTensor
    if not isinstance(p, DTensor):
        return None, None
    shard_dims = [i for i, pl in enumerate(p.placements) if pl.is_shard()]
    if not shard_dims:
        return None, None
    if len(shard_dims) > 1 or not p.placements[shard_dims[0]].is_shard(0):
        raise NotImplementedError(f"Muon over a parameter with placements {p.placements}: fsdpzero gathers whole "
                                  "matrices from dim-0 shards on one mesh dimension only")
    group = p.device_mesh.get_group(shard_dims[0])
    if dist.get_world_size(group) == 1:   # a shard group of one (stage 0's replicate mesh): the local rows are whole
        return None, None
    return group, -(-p.shape[0] // dist.get_world_size(group))


def comm_device() -> torch.device | None:
    """Where Muon's gathers run: the rank's GPU when the process group is NCCL (CPU-offloaded gradients and
    momentum go there for Newton-Schulz, as DeepSpeed's _muon_all_gather_partitions moves them to its accelerator);
    None: where the tensors are (gloo)."""
    if dist.is_initialized() and "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return None


@dataclass(eq=False)
class _Matrix:
    """One matrix's Newton-Schulz in a step. mode: "local" (no other rank: this rank holds and computes it),
    "broadcast" (every rank holds it whole: the owner computes and broadcasts), "gather" (sharded: equal pieces
    of `chunk` leading rows of `piece_shape`, gathered to the owner, the update scattered back)."""
    index: int
    shape: torch.Size        # the whole matrix
    mode: str
    group: Any               # the gather / scatter / broadcast group (None: the default group)
    owner: int               # rank in `group` that runs Newton-Schulz
    piece_shape: tuple       # gather: (chunk, *rest) of this rank's piece
    ns_method: str
    make: Callable[[], torch.Tensor]      # this rank's piece, made when the matrix's window starts
    done: Callable[[torch.Tensor], None]  # takes this rank's piece of the update
    rows: int = 0            # rows of this rank's piece as made (gather: before padding to chunk)
    home: torch.device | None = None
    piece: torch.Tensor | None = None
    pieces: list | None = None
    result: torch.Tensor | None = None


def ns_windows(owners_bytes: list[tuple[int, int]], window_bytes: int) -> list[int]:
    """Where each window of matrices ends (exclusive indices): consecutive matrices, a window closed before any
    owner's whole matrices in it would pass `window_bytes` (an owner's matrix larger than that is its only one in
    its window). Computed from shapes only, so every rank cuts the same windows and issues the same collectives."""
    ends, held = [], {}
    for i, (owner, nbytes) in enumerate(owners_bytes):
        if held and held.get(owner, 0) + nbytes > window_bytes:
            ends.append(i)
            held = {}
        held[owner] = held.get(owner, 0) + nbytes
    return ends + [len(owners_bytes)] if owners_bytes else []


class Orthogonalizer:
    """Newton-Schulz of each matrix on one rank; the owner of the i-th matrix of a step is i mod the group's size.
    Sharded matrices (FSDP2 rows, or stage 1's flat chunks): gathered to the owner, the update scattered back.
    Whole (replicated) matrices: the owner computes and broadcasts (every rank holds the same update). Tensors
    elsewhere than comm_device() (offloaded to the CPU) go there for it and come back.

    Batched: add_rows() / add_flat() queue the step's matrices, run() takes them in windows (ns_windows: at most
    `window_bytes` of whole matrices per owner, at 4 bytes an element, so a window's gathered matrices and its
    Newton-Schulz batches are bounded by it). Per window, on every rank in the same order: its pieces are made and
    all gathers issued (async), then each owner runs Newton-Schulz once per shape on the stack of its matrices of
    that shape, then all scatters / broadcasts are issued and each matrix's `done` gets its piece. window_bytes 0:
    one matrix at a time (the unbatched order)."""

    def __init__(self, window_bytes: int = NS_WINDOW_BYTES):
        self.count = 0
        self.device = comm_device()
        self.window_bytes = window_bytes
        self._queue: list[_Matrix] = []

    def _add(self, mode, shape, group, piece_shape, ns_method, make, done) -> None:
        index, self.count = self.count, self.count + 1
        owner = 0 if mode == "local" else index % dist.get_world_size(group)
        self._queue.append(_Matrix(index, torch.Size(shape), mode, group, owner, tuple(piece_shape), ns_method, make,
                                   done))

    @staticmethod
    def _alone() -> bool:
        return not dist.is_initialized() or dist.get_world_size() == 1

    def add_rows(self, make, p: torch.Tensor, ns_method: str, done) -> None:
        """make(): this rank's rows of parameter p's update to orthogonalize (p: a DTensor sharded on dim 0, or a
        whole tensor); done(u) gets this rank's rows of the orthogonalized update."""
        group, chunk = _shard_layout(p)
        if group is not None:   # sharded: gathered to the owner
            self._add("gather", p.shape, group, (chunk, *p.shape[1:]), ns_method, make, done)
        elif self._alone():
            self._add("local", p.shape, None, (), ns_method, make, done)
        else:   # whole on every rank
            self._add("broadcast", p.shape, None, (), ns_method, make, done)

    def add_flat(self, make, shape: torch.Size, chunk: int, group, ns_method: str, done) -> None:
        """make(): this rank's `chunk` elements of the flattened matrix (stage 1: padded to chunk * world elements;
        alone, the whole matrix flattened); done(u) gets the same chunk of the update."""
        if group is None and self._alone():
            self._add("local", shape, None, (), ns_method, make, done)
        else:
            self._add("gather", shape, group if group is not None else dist.group.WORLD, (chunk,), ns_method, make,
                      done)

    def run(self) -> None:
        queue, self._queue = self._queue, []
        start = 0
        for end in ns_windows([(m.owner, 4 * m.shape.numel()) for m in queue], self.window_bytes):
            self._window(queue[start:end])
            start = end

    def _window(self, window: list[_Matrix]) -> None:
        works = []
        for m in window:   # this rank's pieces; the gathers
            u = m.make()
            m.home, m.rows = u.device, u.shape[0]
            if self.device is not None and u.device != self.device:
                u = u.to(self.device)
            if m.mode == "gather":
                world, rank = dist.get_world_size(m.group), dist.get_rank(m.group)
                if u.shape[0] != m.piece_shape[0]:
                    piece = u.new_zeros(m.piece_shape)
                    piece[:u.shape[0]] = u
                    u = piece
                m.pieces = [torch.empty_like(u) for _ in range(world)] if rank == m.owner else None
                works.append(dist.gather(u, m.pieces, dst=dist.get_global_rank(m.group, m.owner), group=m.group,
                                         async_op=True))
            m.piece = u
        for w in works:
            w.wait()
        batches: dict[tuple, list[_Matrix]] = {}   # the owner's Newton-Schulz, once per shape
        for m in window:
            if m.mode == "local" or dist.get_rank(m.group) == m.owner:
                whole = self._whole(m)
                batches.setdefault((m.ns_method, tuple(whole.shape), whole.dtype, whole.device), []).append(m)
                m.result, m.pieces = whole, None   # the input until its batch runs
        for (ns_method, *_), ms in batches.items():
            for m, out in zip(ms, orthogonalize_batch([m.result for m in ms], ns_method)):
                m.result = out
        works, outs, keep = [], [], []
        for m in window:   # the updates back
            if m.mode == "local":
                out = m.result.reshape(m.piece.shape) if m.result.shape != m.piece.shape else m.result
            elif m.mode == "broadcast":
                out = m.result.contiguous() if m.result is not None else torch.empty_like(m.piece)
                works.append(dist.broadcast(out, src=m.owner, async_op=True))
            else:
                scatter = None
                if m.result is not None:
                    world = dist.get_world_size(m.group)
                    full = m.result.reshape(-1, *m.piece_shape[1:])
                    padded = torch.cat([full, full.new_zeros((m.piece_shape[0] * world - full.shape[0],
                                                              *m.piece_shape[1:]))])
                    scatter = list(padded.split(m.piece_shape[0]))
                    keep.append(scatter)   # alive until the scatter is waited for
                out = torch.empty_like(m.piece)
                works.append(dist.scatter(out, scatter, src=dist.get_global_rank(m.group, m.owner), group=m.group,
                                          async_op=True))
            outs.append(out)
            m.piece = m.pieces = m.result = None
        for w in works:
            w.wait()
        for m, out in zip(window, outs):
            m.done(out[:m.rows].to(m.home))
            m.make = m.done = None   # what they hold (a blend, a momentum) goes with them

    @staticmethod
    def _whole(m: _Matrix) -> torch.Tensor:
        if m.mode == "gather":
            return torch.cat(m.pieces).reshape(-1)[:m.shape.numel()].view(m.shape)
        return m.piece if m.piece.shape == m.shape else m.piece.reshape(-1)[:m.shape.numel()].view(m.shape)


class MuonWithAuxAdam(torch.optim.Optimizer):
    """DeepSpeed 0.19.8's MuonWithAuxAdam: groups with `use_muon` True take Muon, the others AdamW (DeepSpeed's
    adam_update: bias-corrected, eps outside the square root, decoupled weight decay). Works on FSDP2 DTensor
    shards (states are DTensors like the params, so DCP saves them) or whole tensors."""

    def __init__(self, param_groups: Iterable[dict], adam_w_mode: bool = True):
        param_groups = list(param_groups)
        self.adam_w_mode = adam_w_mode   # DeepSpeed's adam_w_mode: false is Adam with L2 (decay added to the grad)
        for group in param_groups:
            if "use_muon" not in group:
                raise ValueError("every MuonWithAuxAdam param group needs a use_muon flag")
            if group["use_muon"]:
                group["params"] = sorted(group["params"], key=lambda x: x.size(), reverse=True)   # as DeepSpeed
                if any(p.ndim < 2 for p in group["params"]):
                    raise ValueError("a use_muon group holds a parameter of fewer than 2 dims: Muon orthogonalizes "
                                     "matrices; put it in a use_muon=False (AdamW) group")
                check_muon_shapes((f"{group.get('name', 'muon')}[{i}]", p.shape)
                                  for i, p in enumerate(group["params"]))
                group.setdefault("lr", 0.02)
                group.setdefault("momentum", 0.95)
                group.setdefault("weight_decay", 0)
                group.setdefault("ns_method", "gram")
                if group["ns_method"] not in NS_METHODS:
                    raise ValueError(f"ns_method must be one of {list(NS_METHODS)}, got {group['ns_method']!r}")
            else:
                group.setdefault("lr", 3e-4)
                group["betas"] = tuple(group.get("betas", (0.9, 0.95)))
                group.setdefault("eps", 1e-10)
                group.setdefault("weight_decay", 0)
        super().__init__(param_groups, {})
        self._flat_slots: dict[int, list[tuple[torch.Size, int, int]]] = {}
        self._flat_group = None
        self._staged: dict | None = None   # orthogonalize_grads' new momenta, committed by step()
        self.ns_window_bytes = NS_WINDOW_BYTES   # the Orthogonalizer's window (0: one matrix at a time)

    def bind_flat_shards(self, flat_groups, process_group) -> None:
        """Stage 1 (fsdpzero_ops.stage1): each param group became flat fp32 master shards, every parameter in them
        flattened, padded and cut into equal chunks. Records each Muon master's matrices: (shape, offset, chunk)."""
        self._flat_group = process_group
        for fg in flat_groups:
            if self.param_groups[fg.group_index]["use_muon"]:
                self._flat_slots[id(fg.master)] = [(s.param.shape, s.offset, s.chunk) for s in fg.slots]

    def _queue_muon(self, group: dict, p: torch.Tensor, grad: torch.Tensor, ortho: "Orthogonalizer", done) -> None:
        """Queues Muon parameter p on `ortho`: when its window starts, the new momentum (from `grad`, this rank's
        piece of the mean gradient) and the nesterov blend are made; done(m, sl, u) then gets the new momentum and,
        for this rank's piece `sl` of p (a slice of a stage-1 flat shard, or all of it), the orthogonalized update.
        The stored momentum is left as it was."""
        state = self.state[p]
        if not state:
            state["momentum_buffer"] = torch.zeros_like(p)
        beta, made = group["momentum"], {}
        slots = self._flat_slots.get(id(p))   # stage 1: a flat shard of matrices, each chunked like Shard(0)
        left = [len(slots) if slots else 1]

        def blend(sl):   # once per parameter (a stage-1 shard's matrices slice one blend), dropped after the last
            if "u" not in made:
                made["m"] = local_tensor(state["momentum_buffer"]).lerp(grad, 1 - beta)
                made["u"] = grad.lerp(made["m"], beta)   # nesterov
            u = made["u"][sl]
            left[0] -= 1
            if not left[0]:
                del made["u"]
            return u

        if slots:
            for shape, offset, chunk in slots:
                sl = slice(offset, offset + chunk)
                ortho.add_flat(lambda sl=sl: blend(sl), shape, chunk, self._flat_group, group["ns_method"],
                               lambda u, sl=sl: done(made["m"], sl, u))
        else:
            ortho.add_rows(lambda: blend(slice(None)), p, group["ns_method"],
                           lambda u: done(made["m"], slice(None), u))

    @torch.no_grad()
    def orthogonalize_grads(self) -> None:
        """DeepSpeed's order at ZeRO 1-3 (stage_1_and_2.get_flat_partition, stage3._apply_muon_to_accumulated_grads):
        each Muon parameter's gradient becomes its orthogonalized update before the global norm is taken, so the
        norm and the gradient clipping cover the update (the AdamW half's raw gradients beside it), and step() then
        applies the clipped update. The momentum moves with the raw gradient; it is staged and committed by step(),
        so a step skipped for overflow leaves it as it was. Once per boundary: a second call before step() or
        drop_staged() does nothing. The matrices' Newton-Schulz runs batched (Orthogonalizer)."""
        if self._staged is not None:
            return
        self._staged = staged = {}
        ortho = Orthogonalizer(self.ns_window_bytes)
        for group in self.param_groups:
            if not group["use_muon"]:
                continue
            for p in group["params"]:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grad = local_tensor(p.grad)

                def done(m, sl, u, p=p, grad=grad):   # the blend of this piece was made: the grad may take u
                    grad[sl].copy_(u)
                    staged[p] = m
                self._queue_muon(group, p, grad, ortho, done)
        ortho.run()

    def drop_staged(self) -> None:
        """Forget a boundary's staged momentum (its step was skipped, or it is done)."""
        self._staged = None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        staged, self._staged = self._staged, None
        ortho = Orthogonalizer(self.ns_window_bytes)
        for group in self.param_groups:   # DeepSpeed without a ZeRO optimizer (stage 0): Muon on the (clipped)
            if not group["use_muon"]:      # gradient here, its matrices batched
                continue
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if staged is not None and p in staged:
                    continue
                grad = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))

                def apply(m, sl, u, p=p, lr=lr, wd=wd):
                    local_tensor(self.state[p]["momentum_buffer"])[sl].copy_(m[sl])
                    w = local_tensor(p)[sl]
                    w.mul_(1 - lr * wd)
                    w.add_(u, alpha=-lr)
                self._queue_muon(group, p, grad, ortho, apply)
        ortho.run()
        for group in self.param_groups:   # the rest by foreach kernels: one launch for many tensors on a GPU
            lr, wd = group["lr"], group["weight_decay"]
            weights, updates = [], []
            if group["use_muon"]:
                momenta, new = [], []
                for p in group["params"]:
                    if staged is None or p not in staged:   # stepped above
                        continue
                    momenta.append(local_tensor(self.state[p]["momentum_buffer"]))
                    new.append(staged[p])
                    weights.append(local_tensor(p))
                    updates.append(local_tensor(p.grad))   # orthogonalize_grads ran: the grad is the update
                if momenta:
                    torch._foreach_copy_(momenta, new)
            else:
                weights, updates = self._adam_updates(group)
            if weights:
                if group["use_muon"] or self.adam_w_mode:
                    torch._foreach_mul_(weights, 1 - lr * wd)
                torch._foreach_add_(weights, updates, alpha=-lr)
        return loss

    def _adam_updates(self, group: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """An AdamW group's (weights, updates): DeepSpeed's adam_update per parameter (m, v moved; the update
        m_hat / (sqrt(v_hat) + eps)), by foreach kernels over the parameters at one step count."""
        by_step: dict[float, list] = {}
        for p in group["params"]:
            state, w = self.state[p], local_tensor(p)
            grad = local_tensor(p.grad) if p.grad is not None else torch.zeros_like(local_tensor(p))
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            if not self.adam_w_mode:
                grad = grad.add(w, alpha=group["weight_decay"])
            by_step.setdefault(float(state["step"]), []).append(
                (w, grad, local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])))
        (beta1, beta2), weights, updates = group["betas"], [], []
        for t, rows in by_step.items():
            ws, gs, ms, vs = (list(x) for x in zip(*rows))
            torch._foreach_lerp_(ms, gs, 1 - beta1)
            torch._foreach_lerp_(vs, torch._foreach_mul(gs, gs), 1 - beta2)
            denom = torch._foreach_div(vs, 1 - beta2 ** t)
            torch._foreach_sqrt_(denom)
            torch._foreach_add_(denom, group["eps"])
            update = torch._foreach_div(ms, 1 - beta1 ** t)
            torch._foreach_div_(update, denom)
            weights += ws
            updates += update
        return weights, updates


class MuonGradPath(GradPath):
    """DeepSpeed's ZeRO 1-3 with Muon: the gradient path of the plan (`inner`), with each Muon matrix's gradient
    turned into its orthogonalized update once the gradients are complete, before the global norm (see
    MuonWithAuxAdam.orthogonalize_grads): `gradient_clipping` then scales the Muon updates and the AdamW gradients
    by one factor, as DeepSpeed's unscale_and_clip_grads does. Every other call is the inner path's. (Stage 0 is
    plain FSDP2 and not wrapped: DeepSpeed clips the raw gradients there, before MuonWithAuxAdam.step.)"""

    def __init__(self, inner: GradPath):
        self.inner = inner
        self.optimizer = inner.optimizer
        self.param_swapper = inner.param_swapper
        self.streams_checkpoints = inner.streams_checkpoints

    def set_sync(self, sync: bool) -> None:
        self.inner.set_sync(sync)

    def finish_gradients(self) -> None:
        self.inner.finish_gradients()
        self.optimizer.orthogonalize_grads()

    def grad_norm(self) -> torch.Tensor:
        return self.inner.grad_norm()

    def scale_grads_(self, factor) -> None:
        self.inner.scale_grads_(factor)

    def can_skip_on_device(self) -> bool:
        return self.inner.can_skip_on_device()

    def step(self, found_inf: torch.Tensor | None = None) -> None:
        commit = getattr(self.optimizer, "commit_staged", None)   # the offload path's CPU Muon (fsdpzero/offload/
        if commit is not None:                                    # muon.py): the step happens, the momentum moves
            commit()
        self.inner.step(found_inf)

    def zero_grad(self) -> None:
        self.inner.zero_grad()
        self.optimizer.drop_staged()   # a skipped step's momentum never lands

    def wait(self) -> None:
        self.inner.wait()

    def close(self) -> None:
        self.inner.close()

    def state_dict(self, streaming: bool = False) -> dict[str, Any]:
        return self.inner.state_dict(streaming)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def async_save(self):
        return self.inner.async_save()

    def keep_masters_on_load(self):
        return self.inner.keep_masters_on_load()
