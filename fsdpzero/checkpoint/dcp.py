"""Sharded, atomic checkpoints in DeepSpeed's directory layout, through torch.distributed.checkpoint (DCP).

    <save_dir>/latest                 the tag of the newest complete checkpoint (replaced atomically)
    <save_dir>/<tag>/                 default tag "global_step{N}"
        .metadata, __{rank}_0.distcp  DCP: every tensor, sharded as it was live; loads on any number of ranks
        state.json                    every non-tensor value (hyperparameters, scheduler, scaler, counters)
        client_state.json             the caller's client_state
        rng_{rank}.safetensors        per-rank RNG states
        fsdpzero_complete.json        the manifest, written last: files, sizes and CRC-32 checksums

Crash safety: ranks write into the save's own <save_dir>/.tmp-<tag>.<token>/, rank 0 fsyncs, writes the manifest,
renames the directory to <tag> (if no other job committed <tag> meanwhile), and only then replaces `latest` (write a
temp file, fsync, rename); fsdpzero.checkpoint.files does that part. A crash at any point leaves `latest` naming the
previous complete checkpoint. Loads agree first on which checkpoint (rank 0 resolves `latest`), then check it.
Nothing is pickled: tensors go to DCP, everything else to JSON (DCP would pickle non-tensor values and read them back
with weights_only=False). DCP's own index (.metadata) is a pickle: it is read through fsdpzero.checkpoint.trust's
allowlisted unpickler, never pickle.load.
This module is the flow: the state split into DCP tensors and JSON, saved (sync or async), loaded and resharded.
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import math
import random
import secrets
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful

from fsdpzero.checkpoint.agree import CheckpointError, agree, broadcast_text, describe, resolve_on_rank0
# MANIFEST, checkpoint_problems and resolve_tag are imported from here too (engine_state, convert, tests)
from fsdpzero.checkpoint.files import (MANIFEST, LatestNotUpdated, SaveRefused, SaveSlot, check_tag,  # noqa: F401
                                       checkpoint_identity, checkpoint_problems, crash_point, read_manifest,
                                       resolve_tag)
from fsdpzero.checkpoint.stream import StreamingLoadPlanner, StreamingSavePlanner, materialize, streamed_state
from fsdpzero.checkpoint.trust import (ChecksumWriter, SafeFileSystemReader, SafeLoadPlanner, UnsafeCheckpointError,
                                       checksum_problems, read_dcp_metadata, tensor_entries)
from fsdpzero.dist import agreed_errors
from fsdpzero.tuning import Tuning, or_defaults

_SEP = "/"  # joins nested keys; FQNs contain dots, never slashes
_pending: "PendingSave | None" = None
_pending_registered = False
_async_group = None  # background saves use their own process group, so they never interleave with training's


class ModelOptimizer(Stateful):
    """Model + optimizer as DCP state: FQN-keyed, sharded (DTensor) entries, so a load reshards N -> M ranks."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer
        self.model_keys: list[str] | None = None   # of the last state_dict(): what a strict load must find
        self.param_shapes: dict[str, tuple] = {}  # and the global shape of each (load_checkpoint checks them)

    def state_dict(self) -> dict:
        if self.optimizer is None:
            sd = {"model": get_state_dict(self.model, [])[0]}
        else:
            unstepped = not self.optimizer.state   # torch then creates the state by a zero-grad step at lr 0
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
            if unstepped:   # give the optimizer its empty state back (its first step stays a true first step)
                from fsdpzero.optim.grad_path import UNSTEPPED, drop_unstepped_state
                optim_sd = drop_unstepped_state(self.optimizer, optim_sd)
                del optim_sd[UNSTEPPED]   # zeroed state: Adam's fresh step 0 and moments for a reader
            sd = {"model": model_sd, "optim": optim_sd}
        self.model_keys = list(sd["model"])
        self.param_shapes = tensor_shapes(sd["model"])
        return sd

    def load_state_dict(self, sd: dict) -> None:
        if self.optimizer is None:
            set_state_dict(self.model, [], model_state_dict=sd["model"], optim_state_dict={})
            return
        from fsdpzero.optim import keeping_impl_flags
        with keeping_impl_flags(self.optimizer):
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                           optim_state_dict=sd.get("optim", {}))


def tensor_shapes(model_sd: dict) -> dict[str, tuple]:
    """{key: global shape} of a model state dict's tensors (what a load compares with the checkpoint's)."""
    return {k: tuple(v.shape) for k, v in model_sd.items() if isinstance(v, torch.Tensor)}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


# ---- nested state <-> (flat tensors for DCP, JSON for the rest) -------------------------------------------------

def _materialize(state: dict) -> dict:
    return {k: (v.state_dict() if isinstance(v, Stateful) or hasattr(v, "load_state_dict") else v)
            for k, v in state.items()}


def _split(obj: Any, prefix: str, tensors: dict, where: str) -> Any:
    """Move tensors into `tensors` (by path) and return the JSON-able remainder with a marker in their place."""
    if isinstance(obj, torch.Tensor):
        tensors[prefix] = obj
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        for k in obj:
            if not isinstance(k, (str, int)) or _SEP in str(k):
                raise TypeError(f"checkpoint state key {where}{_SEP}{k!r}: keys must be str/int without {_SEP!r}")
        return {"__dict__": [[k, _split(v, f"{prefix}{_SEP}{k}", tensors, f"{where}{_SEP}{k}")]
                             for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        items = [_split(v, f"{prefix}{_SEP}{i}", tensors, f"{where}[{i}]") for i, v in enumerate(obj)]
        return {"__tuple__": items} if isinstance(obj, tuple) else items
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"checkpoint state {where} = {type(obj).__name__}: only tensors, numbers, strings, None, lists, "
                    f"tuples and dicts can be saved (no pickle); convert it, e.g. to a tensor or a string")


def _join(obj: Any, tensors: dict, live: Any = None) -> Any:
    """Inverse of _split. Saved subtrees holding tensors that the live state does not have are left out (e.g. the
    optimizer when loading the model only)."""
    if isinstance(obj, list):
        return [_join(v, tensors, live[i] if isinstance(live, (list, tuple)) and i < len(live) else None)
                for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_join(v, tensors) for v in obj["__tuple__"])
        out = {}
        for k, v in obj["__dict__"]:
            if isinstance(live, dict) and k not in live and "__tensor__" in json.dumps(v):
                continue
            out[k] = _join(v, tensors, live.get(k) if isinstance(live, dict) else None)
        return out
    return obj


def _rng_state() -> dict[str, torch.Tensor]:
    version, mt, gauss = random.getstate()
    out = {"torch_cpu": torch.get_rng_state(), "python_mt": torch.tensor(mt, dtype=torch.int64),
           "python_meta": torch.tensor([version, gauss is not None, 0 if gauss is None else 1], dtype=torch.int64),
           "python_gauss": torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64)}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return out


def _set_rng_state(st: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(st["torch_cpu"])
    version, has_gauss, _ = st["python_meta"].tolist()
    random.setstate((version, tuple(st["python_mt"].tolist()),
                     float(st["python_gauss"][0]) if has_gauss else None))
    cuda = [st[k] for k in sorted((k for k in st if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])


# ---- save -----------------------------------------------------------------------------------------------------

def writer_threads(tuning: Tuning | None = None) -> int:
    """The ckpt_writer_threads knob of `tuning` (an engine's settings; called without one: the process defaults)."""
    return or_defaults(tuning).ckpt_writer_threads


class PendingSave:
    """An async save in flight. result() waits for the data and finishes the checkpoint (rename, `latest`); every
    rank calls it (the next save and any load do), as the ranks agree there on whether it worked."""

    def __init__(self, future, finish, fail):
        self._future, self._finish, self._fail, self._path = future, finish, fail, None

    def done(self) -> bool:
        return self._path is not None or self._future.done()

    def result(self, agree_across_ranks: bool = True) -> Path:
        global _pending
        if self._path is None:
            if _pending is self:
                _pending = None   # settled either way: a failed save is not retried by the next one
            try:
                self._future.result()
            except (Exception, CheckpointException) as e:
                self._fail(e)
            self._path = self._finish(agree_across_ranks)
        return self._path


def wait_for_pending_save(agree_across_ranks: bool = True) -> Path | None:
    """Block until the previous async save (if any) is complete on disk."""
    return _pending.result(agree_across_ranks) if _pending is not None else None


def _wait_at_exit() -> None:
    # at interpreter exit the other ranks may be gone: finish this rank's part without a collective
    wait_for_pending_save(agree_across_ranks=False)


def client_state_json(client_state: dict | None) -> str:
    """The caller's client_state as the JSON stored in client_state.json (no tensors allowed there); a TypeError or
    ValueError names what cannot be stored."""
    return json.dumps(_split(client_state or {}, "client", {}, "client_state"))


def save_checkpoint(save_dir: str | Path, tag: str | None, state: dict, client_state: dict | None = None, *,
                    step: int | None = None, save_latest: bool = True, keep_last: int | None = None,
                    async_save: bool = False, save_rng: bool = True, no_dist: bool = False,
                    tuning: Tuning | None = None) -> Path | PendingSave:
    """Save `state` ({name: Stateful | tensor | nested dict}) under <save_dir>/<tag>; collective over all ranks.

    tag defaults to f"global_step{step}"; it must be a plain directory name (files.check_tag). With async_save the
    tensors are staged to CPU and written in the background; the returned PendingSave's result() (or the next save,
    or a load) completes the checkpoint. no_dist: this process alone writes the whole state (offline conversion),
    even if a process group exists. A failure on any rank (an unwritable directory, a full disk) raises the same
    CheckpointError on every rank, after removing this save's temp dir; `latest` keeps naming the previous one. So
    does a tag that names something fsdpzero did not write (a file; a directory is written into, its other files left
    alone), and losing to another job that committed the same tag while this save was writing (files.SaveSlot).
    tuning: this save's settings (ckpt_writer_threads, the ckpt_crash_at test hook): an engine passes its own
    (Engine.tuning); a call without an engine builds them here, once, from the process defaults
    (fsdpzero.tuning.or_defaults: defaults < FSDPZERO_* environment), and passes them down.
    """
    global _pending
    wait_for_pending_save()
    knobs = or_defaults(tuning)
    if tag is None:
        if step is None:
            raise ValueError("save_checkpoint: pass tag=... or step=N (the default tag is f'global_step{N}')")
        tag = f"global_step{step}"
    distributed = dist.is_initialized() and not no_dist
    # what can fail on one rank alone (its tag, its client_state) is agreed before the first collective: every
    # rank raises the same error instead of the others waiting in a mismatched collective
    with agreed_errors() if distributed else contextlib.nullcontext():
        tag = check_tag(tag if isinstance(tag, str) else str(tag))
        client_json = client_state_json(client_state)
    save_dir = Path(save_dir)
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    token = f"{secrets.randbits(64):016x}" if rank == 0 else ""
    slot = SaveSlot(save_dir, tag, broadcast_text(token) if distributed else token,   # rank 0's token on every rank
                    crash_at=knobs.ckpt_crash_at)
    tmp = slot.tmp
    tensors: dict[str, torch.Tensor] = {}
    rest = _split(_materialize(state), "state", tensors, "state")
    streamed = {k: s for k, t in tensors.items() if (s := streamed_state(t)) is not None}   # NVMe states
    if async_save:   # staged up front anyway: read them now
        tensors.update({k: materialize(tensors[k]) for k in streamed})
        streamed = {}
    what = f"saving checkpoint {save_dir / tag}"
    undone = f"; {tmp} removed, nothing saved, `latest` unchanged"

    def agreed(error: str | None, agree_across_ranks: bool = True, message: str | None = None) -> None:
        # every rank learns of any rank's error here, instead of the others waiting in the next collective
        if error is not None and message is None:
            message = f"{what} failed: {error}{undone}"
        try:
            agree(message, CheckpointError, distributed and agree_across_ranks)
        except CheckpointError:
            slot.abandon()
            raise

    error = None
    if rank == 0:
        try:
            slot.open()
            (tmp / "state.json").write_text(json.dumps(rest))
            (tmp / "client_state.json").write_text(client_json)
        except SaveRefused as e:
            error = str(e)
        except Exception as e:   # any local failure is agreed on below, so no rank waits for the others
            error = f"cannot write {tmp} ({describe(e)}); save_dir must be a writable directory"
    agreed(error)    # also the barrier: the directory exists for every rank after it
    error = None
    if save_rng:
        try:
            save_file(_rng_state(), tmp / f"rng_{rank}.safetensors")
        except Exception as e:   # safetensors raises its own SafetensorError for I/O errors
            error = f"cannot write {tmp / f'rng_{rank}.safetensors'} ({describe(e)})"
    agreed(error)
    crash_point("before_data", knobs.ckpt_crash_at)
    # several writer threads per rank (a file each): one thread left a ~1B-model save disk-latency bound.
    # ChecksumWriter: each data file's CRC-32 as it is written, for the manifest
    writer = ChecksumWriter(tmp, sync_files=True, thread_count=knobs.ckpt_writer_threads)

    def failed(e: BaseException):
        # DCP raises on every rank alike (a disk-full CheckpointException is a BaseException): clean up, one line
        logging.getLogger("fsdpzero").debug("checkpoint save failed", exc_info=e)
        slot.abandon()
        raise CheckpointError(f"{what} failed: {describe(e)}{undone}") from None

    def finish(agree_across_ranks: bool = True) -> Path:
        crash_point("mid_write", knobs.ckpt_crash_at)
        error = message = None
        if rank == 0:
            try:
                slot.commit(save_latest, keep_last, world, step)
            except SaveRefused as e:
                error = str(e)
            except LatestNotUpdated as e:   # the checkpoint is there: say so, and nothing else is undone
                error = message = str(e)
            except Exception as e:
                error = f"cannot finish {tmp} ({describe(e)})"
        agreed(error, agree_across_ranks, message)   # the final barrier too
        return save_dir / tag

    if async_save:
        global _async_group, _pending_registered
        if distributed and _async_group is None:
            _async_group = dist.new_group(backend="gloo")
        try:
            future = dcp.async_save(tensors, storage_writer=writer, process_group=_async_group,
                                    no_dist=not distributed)
        except (Exception, CheckpointException) as e:
            failed(e)
        if not _pending_registered:
            atexit.register(_wait_at_exit)  # a run that ends right after an async save still completes it
            _pending_registered = True
        _pending = PendingSave(future, finish, failed)
        return _pending
    planner = None
    if streamed:   # the serial loader: one streamed tensor per writer thread at a time (stream.py)
        planner = StreamingSavePlanner(streamed)
        writer = ChecksumWriter(tmp, sync_files=True, thread_count=knobs.ckpt_writer_threads, per_thread_copy_ahead=0)
    try:
        dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=not distributed)
    except (Exception, CheckpointException) as e:
        failed(e)
    finally:
        if planner is not None:
            planner.finish()
    if planner is not None:
        _log_streamed("saved", planner)
    return finish()


def _log_streamed(what: str, planner) -> None:
    b = planner.bytes
    if _rank() == 0:
        logging.getLogger("fsdpzero").info("checkpoint: %s %.2f GiB of on-disk state streamed, at most "
                                           "%.1f MiB of it in memory at once (rank 0)", what, b.total / 2**30,
                                           b.peak / 2**20)


# ---- loading across layouts ------------------------------------------------------------------------------------

def _shape_text(shape) -> str:
    return f"torch.Size({list(shape)})"   # as torch's load_state_dict prints it


def _size_mismatch(name: str, saved, live) -> str:
    return (f"size mismatch for {name}: copying a param with shape {_shape_text(saved)} from checkpoint, the shape "
            f"in current model is {_shape_text(live)}")


def check_shapes(path: Path, template: dict[str, torch.Tensor], metadata, param_shapes: dict[str, dict]) -> None:
    """Refuse (CheckpointError naming the tensor and both shapes, as torch's load_state_dict words it) a checkpoint
    tensor that would land in a live tensor of another shape, before anything is read. `param_shapes`: {top-level
    state key: {parameter name: live global shape}}. Each parameter is compared with the checkpoint's entry of the
    same name, so a (8, 4) weight never loads into a (4, 8) parameter even where both sides keep its optimizer
    state flat. Flat (1-D) states of the same size as a parameter-shaped one are another layout of the same tensor
    (stage 1 against stages 0/2/3), read whole and cut later (_full_where_layout_differs). Pure: every rank decides
    the same."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    saved = metadata.state_dict_metadata

    def saved_size(key):
        md = saved.get(key)
        return tuple(md.size) if isinstance(md, TensorStorageMetadata) else None

    problems = []
    for top, shapes in param_shapes.items():
        for name, live in shapes.items():
            have = saved_size(f"state{_SEP}{top}{_SEP}model{_SEP}{name}")
            if have is not None and have != tuple(live):
                problems.append(_size_mismatch(name, have, live))
    for key, t in template.items():
        have, live = saved_size(key), tuple(t.shape)
        if have is None or have == live:
            continue
        name = key[len(f"state{_SEP}"):]
        top, _, rest = name.partition(_SEP)
        kind, _, entry = rest.partition(_SEP)
        if kind == "model" and entry in param_shapes.get(top, {}):
            continue   # reported above
        if math.prod(have) == math.prod(live) and (len(have) == 1 or len(live) == 1):
            continue   # another layout of the same tensor
        problems.append(_size_mismatch(name, have, live))
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"checkpoint {path} does not fit the model: {problems[0]}{more}. Load a checkpoint "
                              f"saved from this model's architecture")


def _full_where_layout_differs(template: dict[str, torch.Tensor], metadata) -> dict[str, torch.Tensor]:
    """Entries saved with another shape of the same numel (a stage-1 flat (numel,) state against a stage 0/2/3
    parameter-shaped one, either way; check_shapes has refused any other) are read in full, in the saved dtype,
    into plain CPU tensors that replace them in `template`; the live tensors are returned by key, for
    _copy_full_into after the load. Memory: every such entry is held whole on every rank for the duration of the
    load (a one-time cost of a cross-layout resume: about 12 bytes per parameter for fp32 weights and two Adam
    moments)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    saved = metadata.state_dict_metadata
    relaid = {}
    for key, t in template.items():
        md = saved.get(key)
        if isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(t.shape) and md.size.numel() == t.numel():
            relaid[key] = t
            template[key] = torch.empty(md.size, dtype=md.properties.dtype)
    return relaid


def _strided_piece(full: torch.Tensor, target) -> torch.Tensor:
    """This rank's piece of `full` for a DTensor whose placements are not plain Shard/Replicate (FSDP2's _StridedShard
    over a tensor-parallel Shard of the same dim). DTensor cuts an index vector of the sharded dim (distribute_tensor
    moves what it cuts to the mesh's device: a vector, not the whole entry) and the CPU entry is gathered by it."""
    from torch.distributed.tensor import distribute_tensor
    dims = {p.dim for p in target.placements if not p.is_replicate()}
    if len(dims) != 1:   # shards of several dims: cut the entry itself
        return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local().cpu()
    (dim,) = dims
    index = torch.arange(full.shape[dim]).view([-1 if d == dim else 1 for d in range(full.dim())])
    local = distribute_tensor(index, target.device_mesh, target.placements, src_data_rank=None).to_local()
    return full.index_select(dim, local.reshape(-1).cpu())


@torch.no_grad()
def _copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """target <- full, reshaped to target's (global) shape; a DTensor takes only its own local piece, cut as DTensor
    cuts it (torch.chunk along each sharded dim, mesh dim by mesh dim), with no communication."""
    full, s = full.reshape(target.shape), streamed_state(target)   # s: an NVMe state, written to its swap file
    if not hasattr(target, "to_local"):
        if s is not None:
            s.write(full.to(s.dtype).contiguous())
        else:
            target.copy_(full)
        return
    piece, coord = full, target.device_mesh.get_coordinate()
    if all(p.is_shard() or p.is_replicate() for p in target.placements):
        for mesh_dim, placement in enumerate(target.placements):
            if placement.is_shard():
                dim = placement.dim
                chunks = torch.chunk(piece, target.device_mesh.size(mesh_dim), dim=dim)
                piece = chunks[coord[mesh_dim]] if coord[mesh_dim] < len(chunks) else piece.narrow(dim, 0, 0)
    else:   # FSDP2 over a tensor-parallel shard (_StridedShard): DTensor's own cut, local (src_data_rank=None)
        piece = _strided_piece(full, target)
    local = torch.empty(s.local_shape, device="meta") if s is not None else target.to_local()
    if piece.shape != local.shape:
        raise RuntimeError(f"checkpoint entry of shape {tuple(full.shape)}: this rank's piece is {tuple(piece.shape)}, "
                           f"its live shard {tuple(local.shape)}")
    if s is not None:
        s.write(piece.to(s.dtype).contiguous())
    else:
        local.copy_(piece)


_IDENTITY = "loaded_identity"   # in verify_checkpoint's manifest: which checkpoint was verified (not a file key)


def replaced(path: Path, manifest: dict) -> str | None:
    """Why what was verified is no longer <path> (another job re-saved the tag: the directory renamed into place or
    its files and manifest replaced), or None. A load re-checks this after its reads: a file read by path after the
    swap belongs to the other save."""
    now = checkpoint_identity(path)
    if now == manifest.get(_IDENTITY):
        return None
    if now is None:
        return (f"checkpoint {path} was removed while it was being loaded (another job's keep_last, or a re-save of "
                f"tag {path.name!r} in progress); what was read is incomplete, so nothing of it counts")
    return (f"checkpoint {path} was replaced while it was being loaded (another job re-saved tag {path.name!r} "
            f"into {path.parent}); what was read mixes two saves, so nothing of it counts: load again once that "
            f"save is done, or load another tag")


def verify_checkpoint(path: Path, distributed: bool | None = None) -> dict:
    """Complete (every file of the manifest, at its size) and intact (each rank re-hashes every world-th file
    against the manifest's CRC-32; checkpoints from before checksums have none to check), agreed across ranks.
    Returns the manifest, with which checkpoint it is (directory and manifest digest: load_verified checks again
    after reading that it was not replaced meanwhile). FileNotFoundError / CheckpointError, the same on every rank."""
    distributed = dist.is_initialized() if distributed is None else distributed
    identity = checkpoint_identity(path)
    problems = checkpoint_problems(path)
    agree(f"checkpoint {path} is incomplete:\n  " + "\n  ".join(problems) if problems else None,
          FileNotFoundError, distributed)
    manifest = read_manifest(path)
    manifest[_IDENTITY] = identity
    rank, world = (_rank(), _world()) if distributed else (0, 1)
    if world > 1:   # the same checkpoint, not one of the same name (a stale copy on another node's storage)
        digest = identity[2] if identity is not None else ""
        agree(f"checkpoint {path} on rank {rank} is not the one rank 0 loads (their manifests differ): every rank "
              f"must see the same checkpoint directory, and no other job may re-save it while it loads"
              if broadcast_text(digest) != digest else None)
    bad = checksum_problems(path, manifest.get("checksums", {}), rank, world)
    # a file that no longer matches because another save replaced it is not a damaged checkpoint
    agree(replaced(path, manifest), CheckpointError, distributed)
    agree(f"checkpoint {path} is damaged: {bad[0]}" if bad else None, CheckpointError, distributed)
    return manifest


def read_saved_json(path: Path, name: str):
    """A JSON file of a verified checkpoint (state.json, client_state.json); CheckpointError if it does not parse (a
    checkpoint from before checksums can still be damaged)."""
    try:
        return json.loads((path / name).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint {path} is damaged: {path / name} cannot be read ({describe(e)})") from None


def model_key_problem(path: Path, saved: list[str], live: list[str]) -> str | None:
    """None when the checkpoint's model keys are the model's, else one line listing a few of each side."""
    saved_set, live_set = set(saved), set(live)
    missing = [k for k in live if k not in saved_set]
    unexpected = [k for k in saved if k not in live_set]
    if not missing and not unexpected:
        return None

    def few(keys):
        return ", ".join(keys[:4]) + (", ..." if len(keys) > 4 else "")
    parts = []
    if missing:
        parts.append(f"{len(missing)} key(s) of the model are not in it ({few(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} key(s) in it are not in the model ({few(unexpected)})")
    return (f"checkpoint {path} does not match the model: " + "; ".join(parts) + ". Load a checkpoint of this "
            f"model, or pass strict=False (engine.load_checkpoint: load_module_strict=False) to load only the "
            f"keys both have")


def _saved_model_keys(saved_entry) -> list[str] | None:
    """The model keys saved under one top-level state entry ({"model": {...}, ...}), from state.json."""
    if not isinstance(saved_entry, dict) or "__dict__" not in saved_entry:
        return None
    for key, value in saved_entry["__dict__"]:
        if key == "model" and isinstance(value, dict) and "__dict__" in value:
            return [k for k, _ in value["__dict__"]]
    return None


def load_checkpoint(load_dir: str | Path, tag: str | None = None, state: dict | None = None, *,
                    load_rng: bool = True, strict: bool = True) -> tuple[Path, dict]:
    """Load <load_dir>/<tag or latest> into `state` (same structure as saved; Stateful objects get
    load_state_dict, dicts are updated in place). Reshards to the current world size. Returns (path, client_state).
    Keys of `state` that the checkpoint lacks raise; keys left out of `state` are not loaded. A tensor saved in
    another shape of the same size (another stage's optimizer layout) is read whole and cut to the live layout.

    Checked first, the same on every rank: which checkpoint (rank 0 resolves the tag or `latest` and every rank
    loads that one: agree.resolve_on_rank0), the tag (files.check_tag), completeness and checksums
    (verify_checkpoint), DCP's index through the allowlisted reader (trust.py), every tensor's shape against the
    live one (check_shapes), and, with strict, that the model keys of each Stateful that reports them
    (`model_keys`: ModelOptimizer, the Engine's state) are exactly the checkpoint's; strict=False loads the keys
    both sides have and leaves the rest as they are. A failure inside DCP is a CheckpointError too."""
    wait_for_pending_save()
    path = resolve_on_rank0(load_dir, tag)
    return load_verified(path, verify_checkpoint(path), state, load_rng=load_rng, strict=strict)


def load_verified(path: Path, manifest: dict, state: dict | None = None, *, load_rng: bool = True,
                  strict: bool = True) -> tuple[Path, dict]:
    """load_checkpoint of a checkpoint directory the ranks have agreed on and verified (verify_checkpoint's
    manifest): what the Engine's load calls after choosing it."""
    saved = read_saved_json(path, "state.json")
    metadata = read_dcp_metadata(path)
    state = state if state is not None else {}
    saved_top = dict(saved["__dict__"])
    missing = [k for k in state if k not in saved_top]
    if missing:
        raise KeyError(f"checkpoint {path} has no {missing}; it has {sorted(saved_top)}")
    live = _materialize(state)
    if strict:
        for k, target in state.items():
            live_keys, saved_keys = getattr(target, "model_keys", None), _saved_model_keys(saved_top[k])
            if live_keys is not None and saved_keys is not None:
                problem = model_key_problem(path, saved_keys, list(live_keys))
                if problem:
                    raise CheckpointError(problem)
    template: dict[str, torch.Tensor] = {}
    _split({k: live[k] for k in state}, "state", template, "state")
    tensor_entries(metadata, path, template)
    check_shapes(path, template, metadata, {k: getattr(target, "param_shapes", None) or {}
                                            for k, target in state.items()})
    relaid = _full_where_layout_differs(template, metadata)
    streamed = {k: s for k, t in template.items() if (s := streamed_state(t)) is not None}   # NVMe states
    planner = (StreamingLoadPlanner(streamed, allow_partial_load=not strict) if streamed
               else SafeLoadPlanner(allow_partial_load=not strict))
    try:
        dcp.load(template, checkpoint_id=path, storage_reader=SafeFileSystemReader(path), planner=planner)
        if streamed:
            planner.finish()
    except (Exception, CheckpointException) as e:
        # DCP raises its CheckpointException (a BaseException, which `except Exception` misses) on every rank alike
        logging.getLogger("fsdpzero").debug("checkpoint load failed", exc_info=e)
        agree(replaced(path, manifest))   # a file vanished or changed under the read: say so, not "damaged"
        refused = _refusal(e)
        if refused is not None:
            raise refused from None
        raise CheckpointError(f"loading checkpoint {path} failed: {describe(e)}") from None
    rng, rng_state, problem = path / f"rng_{_rank()}.safetensors", None, None
    try:   # every read of the checkpoint before it is checked to be the one verified
        client = read_saved_json(path, "client_state.json")
        if load_rng and rng.is_file() and manifest["world_size"] == _world():
            rng_state = load_file(rng)
    except (CheckpointError, OSError, ValueError) as e:
        problem = str(e) if isinstance(e, CheckpointError) else f"checkpoint {path}: {rng} unreadable ({describe(e)})"
    agree(replaced(path, manifest) or problem)   # on every rank: one rank may have read the other save's files
    if streamed:
        _log_streamed("loaded", planner)
    for key, target in relaid.items():
        _copy_full_into(target, template[key])
        template[key] = target
    loaded = {k: _join(saved_top[k], template, live[k]) for k in state}
    for k, target in state.items():
        if isinstance(target, Stateful) or hasattr(target, "load_state_dict"):
            target.load_state_dict(loaded[k])
        elif isinstance(target, dict):
            target.clear()
            target.update(loaded[k])
        elif isinstance(target, torch.Tensor):
            target.copy_(loaded[k])
        else:
            raise TypeError(f"load_checkpoint: state[{k!r}] is a {type(target).__name__}; pass a Stateful, a dict "
                            f"or a tensor so it can be loaded in place")
    if rng_state is not None:
        _set_rng_state(rng_state)
    return path, _join(client, {})


def _refusal(e: BaseException) -> BaseException | None:
    """The allowlisted reader's own refusal (UnsafeCheckpointError) inside a DCP failure, raised as itself."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = failures[min(failures)]
        e = inner[0] if isinstance(inner, tuple) else inner
    return e if isinstance(e, UnsafeCheckpointError) else None
