"""The device mesh of a run: data-parallel dimensions (what FSDP2 shards or replicates over), then the model-parallel
ones, innermost last (tensor parallelism talks every layer: its ranks are neighbours, one node's NVLink).

    (dp,)                        ZeRO 1-3
    (replicate, shard)           stage 0, MiCS / hybrid sharding
    (dp, tp) / (replicate, shard, tp)   with tensor_parallel.autotp_size = tp > 1

A model-parallel dimension of size 1 is left out, so a run without it has the mesh it always had. Ulysses sequence
parallelism is not a dimension here: ZeRO shards over dp x sp as DeepSpeed does, so its groups are process groups
inside the data dimension (fsdpzero/parallel/ulysses.py); a model-parallel dimension would leave sp out of ZeRO.
"""
from __future__ import annotations

import math

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

# Model-parallel dimension names, outermost first; every other dimension of a mesh is a data-parallel one.
MODEL_DIMS = ("tp",)


def build_parallel_mesh(device_type: str, data_shape: tuple[int, ...], data_names: tuple[str, ...],
                        **model_sizes: int) -> DeviceMesh:
    """init_device_mesh over (data dims..., model dims...). model_sizes: sizes by name in MODEL_DIMS (tp=2);
    a size of 1 (or absent) adds no dimension. Raises ValueError when the sizes do not multiply to the world."""
    unknown = set(model_sizes) - set(MODEL_DIMS)
    if unknown:
        raise ValueError(f"unknown model-parallel dimension(s) {sorted(unknown)}: use {list(MODEL_DIMS)}")
    clash = set(data_names) & set(MODEL_DIMS)
    if clash:
        raise ValueError(f"data-parallel dimension names {sorted(clash)} are reserved for model parallelism")
    shape, names = list(data_shape), list(data_names)
    for name in MODEL_DIMS:
        size = int(model_sizes.get(name, 1))
        if size > 1:
            shape.append(size)
            names.append(name)
    mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    if hasattr(mesh, "_flatten"):
        # a reduction over several dimensions (the global grad norm of 2-D DTensors) is then one all-reduce over the
        # flattened mesh instead of one per dimension (torch warns about the sequential ones): each run of
        # dimensions ending at the innermost, the ones a sharded parameter's norm reduces over
        for start in range(len(names) - 1):
            mesh[tuple(names[start:])]._flatten("_".join(names[start:]))
    return mesh


def check_user_mesh(mesh: DeviceMesh, tp: int) -> None:
    """A mesh the caller built (wrap(mesh=...)) agrees with tensor_parallel.autotp_size = tp: a "tp" dimension of
    that size, or none when tp is 1. Reads the mesh's shape only (no collective), so every rank raises the same
    error. Without this a mesh lacking "tp" silently trains without tensor parallelism, and a "tp" dimension the
    config does not ask for leaves its ranks unsynchronized replicas (FSDP2 reduces over the data dimensions only)."""
    names = tuple(mesh.mesh_dim_names or ())
    have = mesh.size(names.index("tp")) if "tp" in names else 1
    if have == tp:
        return
    shape = dict(zip(names, mesh.shape)) if names else tuple(mesh.shape)
    if "tp" not in names:
        raise ValueError(f"tensor_parallel.autotp_size = {tp} but the mesh passed in (mesh=...) has no 'tp' "
                         f"dimension ({shape}): add a 'tp' dimension of size {tp} innermost (fsdpzero.parallel."
                         f"build_parallel_mesh(..., tp={tp})) or leave mesh= out and fsdpzero builds it")
    if tp > 1:
        raise ValueError(f"tensor_parallel.autotp_size = {tp} but the mesh passed in (mesh=...) has a 'tp' "
                         f"dimension of size {have} ({shape}): give the mesh a 'tp' dimension of size {tp}, or set "
                         f"tensor_parallel.autotp_size to {have}")
    raise ValueError(f"tensor_parallel.autotp_size = 1 (or absent) but the mesh passed in (mesh=...) has a 'tp' "
                     f"dimension of size {have} ({shape}): set tensor_parallel.autotp_size to {have}, or pass a mesh "
                     f"without 'tp'")


def mesh_size(mesh: DeviceMesh) -> int:
    return math.prod(mesh.shape)


def data_dims(mesh: DeviceMesh) -> tuple[str | int, ...]:
    """The data-parallel dimensions by name (by index for a mesh without names: then all of them)."""
    if mesh.mesh_dim_names is None:
        return tuple(range(mesh.ndim))
    return tuple(n for n in mesh.mesh_dim_names if n not in MODEL_DIMS)


def data_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The sub-mesh of the data-parallel dimensions: what fully_shard and the ZeRO paths get. The mesh itself when it
    has no model-parallel dimension (FSDP2 and DTensor then see exactly the mesh they always saw)."""
    dims = data_dims(mesh)
    if mesh.mesh_dim_names is None or len(dims) == mesh.ndim:
        return mesh
    return mesh[dims]


def model_mesh(mesh: DeviceMesh | None, name: str) -> DeviceMesh | None:
    """The 1-D sub-mesh of model-parallel dimension `name` ("tp", "sp"), or None when the run has none."""
    if mesh is None or name not in (mesh.mesh_dim_names or ()):
        return None
    return mesh[name]


def flat_group(mesh: DeviceMesh):
    """One process group over every rank of `mesh` (a data mesh: (dp,) or MiCS's (replicate, shard)), for code that
    reduces over all data ranks at once (the stage-1 optimizer). DeviceMesh.get_group() refuses a 2-D mesh."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.mesh_dim_names is None:   # torch flattens only a named mesh; an unnamed one is data dimensions only
        if mesh_size(mesh) == dist.get_world_size():   # (check_user_mesh asks "tp" by name): the default group
            return dist.group.WORLD
        raise ValueError(f"wrap(mesh=...): ZeRO stage 1 shards its optimizer over all {mesh_size(mesh)} ranks of the "
                         f"{tuple(mesh.shape)} mesh passed in, which torch can group only for a mesh with names: build "
                         "it with mesh_dim_names=('replicate', 'shard')")
    return mesh._flatten().get_group()   # a 1-D mesh over the same ranks, its group created once and cached


def data_rank_and_size(mesh: DeviceMesh | None) -> tuple[int, int]:
    """This rank's index among the data-parallel replicas and their number: which slice of the global batch it
    reads. Ranks of one tensor-parallel group read the same samples. (0, 1) without a mesh."""
    if mesh is None:
        return 0, 1
    dims = data_dims(mesh)
    coord = mesh.get_coordinate()
    rank, size = 0, 1
    for i, name in enumerate(mesh.mesh_dim_names or range(mesh.ndim)):
        if name in dims:
            rank = rank * mesh.size(i) + coord[i]
            size *= mesh.size(i)
    return rank, size


__all__ = ["MODEL_DIMS", "build_parallel_mesh", "check_user_mesh", "data_dims", "data_mesh", "data_rank_and_size",
           "flat_group", "mesh_size", "model_mesh"]
